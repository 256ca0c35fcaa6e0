"""Count the collectives (and their ring bytes) any torch code issues, DTensor's included."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from lightning_seqpar._compat import TorchDispatchMode, tree_flatten
from lightning_seqpar.parallel.collectives import CollectiveRecord, CommunicationLog

# op name → (kind, which tensor has the full (unsharded) size: "out", or the position of the argument holding it)
_COLLECTIVES = {
    "all_gather_into_tensor": ("all_gather", "out"),
    "_allgather_base_": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", 0),  # functional: (input, op, group size, group name)
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # c10d: (output, input, ...)
    "all_reduce": ("all_reduce", 0),
    "allreduce_": ("all_reduce", 0),
}


_POINT_TO_POINT = {"send", "recv_", "recv_any_source_"}
_WAITS = {"wait_tensor"}  # functional collectives' completion (DTensor's)


class CollectiveCounter(TorchDispatchMode):
    """Record every ``c10d`` / functional-collective op dispatched while active into ``log``.

    Bytes are those of the full tensor, as in :class:`~lightning_seqpar.CommunicationLog` (whose
    ``bytes_moved`` turns them into per-rank ring traffic), so both libraries are measured alike. Point-to-point
    sends add their payload to :attr:`sent_bytes`. ``timed``: :attr:`seconds` sums the host time spent inside
    collective, point-to-point and ``wait_tensor`` calls (blocking ones wait there; a ``Work.wait`` is not a
    dispatched op and is not seen).
    """

    def __init__(self, group_size: int, log: Optional[CommunicationLog] = None, timed: bool = False) -> None:
        super().__init__()
        self.group_size = group_size
        self.log = log or CommunicationLog()
        self.timed, self.seconds, self.sent_bytes = timed, 0.0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func.overloadpacket.__name__  # e.g. "_allgather_base_"
        watched = name in _COLLECTIVES or name in _POINT_TO_POINT or name in _WAITS
        start = time.perf_counter() if self.timed and watched else 0.0
        out = func(*args, **(kwargs or {}))
        if self.timed and watched:
            self.seconds += time.perf_counter() - start
        if name == "send":
            self.sent_bytes += sum(t.numel() * t.element_size() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))
        if name in _COLLECTIVES:
            kind, which = _COLLECTIVES[name]
            tensors = [t for t in tree_flatten(out if which == "out" else args[which])[0] if isinstance(t, torch.Tensor)]
            full = tensors[0]
            self.log.records.append(CollectiveRecord(kind, full.numel() * full.element_size(), self.group_size))
        return out
