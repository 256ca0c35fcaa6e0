"""Host reads of device values in the training step: counted on any device, and refused by CUDA's own detector.

A read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a kernel that sizes its
output from data) waits for every kernel queued before it: on a GPU the CPU stops running ahead and the step's
collectives and kernels stop overlapping. NCCL users see it as idle gaps; gloo on CPU hides it entirely, because the
CPU runs the kernels itself. So the reads are counted where they are made, which works on CPU too:

* ``aten._local_scalar_dense`` (what ``.item()``, ``float()``, ``int()`` and ``bool()`` of a tensor, and a kernel's
  own read, reach) is counted by a dispatch mode;
* ``Tensor.tolist`` reaches no dispatch mode on CPU, so it is counted by wrapping the method for the duration of the
  block (and only then: see ``docs/architecture.md``, interpositions);
* ``dist.barrier`` (``c10d.barrier``), counted by the same dispatch mode: NCCL's barrier blocks the host until the
  device has run it on every rank, while gloo's costs next to nothing. Lightning's ``_sync_ddp`` puts one before
  every ``self.log(..., sync_dist=True)``, which is why the strategy's ``reduce`` does not call it.

On CUDA, :class:`HostSyncCounter` can also run the steps under ``torch.cuda.set_sync_debug_mode``, which sees every
synchronizing call the driver makes (device-to-host copies included), with ``"error"`` raising at the call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch

from lightning_seqpar._compat import BARRIER, SCALAR_READ, TorchDispatchMode


@dataclass
class HostReads:
    """What a block read on the host: ``scalars``, the reads of one value (``.item()``, ``float()``, a kernel's own);
    ``lists``, the element count of each ``.tolist()``; ``barriers``, the ``dist.barrier`` calls (a host wait on
    NCCL)."""

    scalars: int = 0
    lists: list[int] = field(default_factory=list)
    barriers: int = 0

    @property
    def total(self) -> int:
        """Every read and barrier, each ``.tolist()`` counted once."""
        return self.scalars + len(self.lists) + self.barriers


class _ScalarReads(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads.scalars += func is SCALAR_READ
        self.reads.barriers += func is BARRIER
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_host_reads(into: Optional[HostReads] = None) -> Iterator[HostReads]:
    """Count the host reads made inside the block (of this thread's operations; ``.tolist()`` of any thread), added
    to ``into`` (a new :class:`HostReads` when ``None``), which the block receives."""
    reads = HostReads() if into is None else into
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor: torch.Tensor) -> Any:
        reads.lists.append(tensor.numel())
        return tolist(tensor)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with _ScalarReads(reads):
            yield reads
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


class HostSyncCounter(pl.Callback):
    """Counts the host reads inside the strategy's ``training_step`` and ``backward`` (forward, loss and backward of
    every micro-batch; under a pipeline, the whole schedule), one entry per ``training_step`` call.

    The first step of a pipeline exchanges its activation shapes once (documented in ``docs/gpus.md``); every later
    step is expected to read nothing unless a documented part says so (one ``.tolist()`` of the split sizes per
    mixture-of-experts layer call without an expert capacity).

    Args:
        cuda_sync_debug: on a CUDA device, run the calls after the first under
            ``torch.cuda.set_sync_debug_mode(cuda_sync_debug)``: ``"warn"`` or ``"error"`` (raise at the synchronizing
            call); ``None``: off.

    Attributes:
        per_step: host reads (:attr:`HostReads.total`) of each ``training_step`` call and the backward after it.
        reads: the :class:`HostReads` of each call.

    Raises:
        ValueError: an unknown ``cuda_sync_debug``.
    """

    def __init__(self, cuda_sync_debug: Optional[str] = None) -> None:
        if cuda_sync_debug not in (None, "warn", "error"):
            raise ValueError(f"cuda_sync_debug={cuda_sync_debug!r}: 'warn', 'error' or None.")
        self.cuda_sync_debug = cuda_sync_debug
        self.reads: list[HostReads] = []
        self._wrapped: list[tuple[Any, str]] = []

    @property
    def per_step(self) -> list[int]:
        return [reads.total for reads in self.reads]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The strategy's own methods, on the instance and for this run only: Lightning's loop calls them by attribute.
        for name in ("training_step", "backward"):
            setattr(trainer.strategy, name, self._counted(getattr(trainer.strategy, name), name == "training_step"))
            self._wrapped.append((trainer.strategy, name))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for strategy, name in self._wrapped:
            vars(strategy).pop(name, None)
        self._wrapped.clear()

    def _counted(self, original: Callable, starts_a_step: bool) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if starts_a_step:
                self.reads.append(HostReads())
            debug = self.cuda_sync_debug is not None and torch.cuda.is_available() and len(self.reads) > 1
            if debug:
                torch.cuda.set_sync_debug_mode(self.cuda_sync_debug)
            try:
                with counting_host_reads(into=self.reads[-1]):
                    return original(*args, **kwargs)
            finally:
                if debug:
                    torch.cuda.set_sync_debug_mode(0)
        return counted
