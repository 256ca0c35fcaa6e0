"""Count the collectives (and their ring bytes) any torch code issues, DTensor's included."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_seqpar._compat import TorchDispatchMode, tree_flatten
from lightning_seqpar.parallel.collectives import CollectiveRecord, CommunicationLog

# op name → (kind, which tensor has the full (unsharded) size: "out" or "in")
_COLLECTIVES = {
    "all_gather_into_tensor": ("all_gather", "out"),
    "_allgather_base_": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "all_reduce": ("all_reduce", "in"),
    "allreduce_": ("all_reduce", "in"),
}


class CollectiveCounter(TorchDispatchMode):
    """Record every ``c10d`` / functional-collective op dispatched while active into ``log``.

    Bytes are those of the full tensor, as in :class:`~lightning_seqpar.CommunicationLog` (whose
    ``bytes_moved`` turns them into per-rank ring traffic), so both libraries are measured alike.
    """

    def __init__(self, group_size: int, log: Optional[CommunicationLog] = None) -> None:
        super().__init__()
        self.group_size = group_size
        self.log = log or CommunicationLog()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__  # e.g. "_allgather_base_"
        if name in _COLLECTIVES:
            kind, which = _COLLECTIVES[name]
            tensors = [t for t in tree_flatten(out if which == "out" else (args, kwargs))[0] if isinstance(t, torch.Tensor)]
            full = tensors[0]
            self.log.records.append(CollectiveRecord(kind, full.numel() * full.element_size(), self.group_size))
        return out
