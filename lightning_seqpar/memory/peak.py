"""The peak of live tensor bytes over a whole training step (forward, backward, gradient reduction, optimizer), on
any device, CPU included: what a GPU's allocator would have to hold at its fullest, less its rounding and cache.

Every storage the step's ops create is seen below autograd (a ``TorchDispatchMode``: backward's and the optimizer's
temporaries included) and weakly referenced with a callback, so the live total falls when a storage is freed and
the peak is read after every op. Storages that exist before the step (parameters, optimizer state, gradient
buckets, the batch) are counted from :meth:`PeakMemoryTracker.hold`, and leave the total when freed too. A storage
first seen as the output of a view was made outside the dispatcher, by a backend's own machinery (gloo's
reduce-scatter stages a copy of its whole input; NCCL's does not): it is not counted, so the peak is what the step's
own ops hold. Nor is the CPU generator's state (a ``uint8`` vector of its size), which recomputation saves per
checkpointed region: in a GPU run it lives in host memory. The same
mechanism as torch's ``torch.distributed._tools.mem_tracker.MemTracker``, without its global module and optimizer
hooks (a pipeline schedule runs modules out of their forward/backward order) and without the per-module snapshots.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from lightning_seqpar._compat import TorchDispatchMode, local_tensor
from lightning_seqpar.memory.tracker import host_rng_state, operator_tensors


class PeakMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the storages held or created while active (bytes of distinct storages).

    Use around a training step::

        with PeakMemoryTracker() as tracker:
            tracker.hold(model.parameters(), optimizer_state_tensors)
            loss = step()
        tracker.peak  # bytes

    Attributes:
        live: bytes of the tracked storages alive now.
        peak: the largest ``live`` seen after any op (bytes).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}  # id of a live storage object -> its weak reference

    def hold(self, *tensors: Iterable[Optional[torch.Tensor]]) -> "PeakMemoryTracker":
        """Count the storages of ``tensors`` (iterables of tensors; ``None`` skipped) from now until they are freed."""
        for group in tensors:
            for t in group:
                if isinstance(t, torch.Tensor):
                    self._track(t)
        self.peak = max(self.peak, self.live)
        return self

    def _track(self, t: torch.Tensor) -> None:
        t = local_tensor(t)  # a DTensor's memory is its local shard's
        if t.device.type == "meta" or host_rng_state(t):
            return
        # torch keeps one Python object per live storage (storages preserve their PyObject), so its id and a weak
        # reference to it last exactly as long as the memory.
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs:
            return
        size = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key, size=size: self._free(key, size))
        self.live += size

    def _free(self, key: int, size: int) -> None:
        self._refs.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out  # shares its input's storage (see the module docstring)
        for t in operator_tensors(out):
            self._track(t)
        self.peak = max(self.peak, self.live)
        return out
