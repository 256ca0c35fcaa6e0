"""Whole tensors out of ZeRO-1's element ranges, each to one owner rank and back.

Under ``zero=1`` (:mod:`~lightning_seqpar.optim.distributed_optimizer`) data-parallel rank ``j`` of ``d`` holds the
range :func:`~lightning_seqpar.optim.sharded_buckets.owned_range` ``(n, d, j)`` of each flattened tensor of ``n``
elements. An update that reads the whole tensor (Muon's orthogonalisation) first brings every rank's range of it to
one owner (:func:`gather_ranges`: the owner then holds the tensor, rank order being element order), then the result's
ranges back (:func:`scatter_ranges`). Owners are given by the caller, the same on every rank. One ``all_to_all_v``
each way over the data-parallel group; the split sizes follow from ``n`` and ``d`` on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_seqpar.optim.matrix_owners import exchange
from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.parallel.collectives import ParallelGroup


def _size(n: int, group: ParallelGroup, rank: int) -> int:
    start, stop = owned_range(n, group.size, rank)
    return stop - start


def gather_ranges(ranges: Sequence[Tensor], numels: Sequence[int], group: ParallelGroup, owner: Sequence[int],
                  dtype: torch.dtype) -> dict[int, Tensor]:
    """The flat whole of each tensor this rank owns (``owner[i] == group.rank``), ``{i: [numels[i]]}``, from every
    rank's range of it (``ranges[i]``: this rank's, flat). Collective over ``group``: every rank passes the same
    tensors in the same order."""
    if not ranges:
        return {}
    mine = [i for i, o in enumerate(owner) if o == group.rank]
    if group.size == 1:
        return {i: ranges[i].to(dtype) for i in mine}
    send = [[ranges[i].to(dtype).reshape(-1) for i in range(len(ranges)) if owner[i] == dest]
            for dest in range(group.size)]
    counts = [sum(_size(numels[i], group, source) for i in mine) for source in range(group.size)]
    received = exchange(send, counts, group, dtype, ranges[0].device)
    parts: dict[int, list[Tensor]] = {i: [] for i in mine}
    for source, chunk in enumerate(received):
        offset = 0
        for i in mine:
            n = _size(numels[i], group, source)
            parts[i].append(chunk[offset:offset + n])
            offset += n
    return {i: torch.cat(parts[i]) for i in mine}


def scatter_ranges(wholes: dict[int, Tensor], numels: Sequence[int], group: ParallelGroup, owner: Sequence[int],
                   dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """This rank's range of each tensor (flat, ``dtype``), from the owners' wholes (``wholes``: this rank's own,
    ``{i: [numels[i]]}``). Collective over ``group``, the inverse of :func:`gather_ranges`."""
    if not numels:
        return []
    if group.size == 1:
        return [wholes[i].to(dtype).reshape(-1) for i in range(len(numels))]
    mine = [i for i, o in enumerate(owner) if o == group.rank]
    send = []
    for dest in range(group.size):
        pieces = []
        for i in mine:
            start, stop = owned_range(numels[i], group.size, dest)
            pieces.append(wholes[i].reshape(-1)[start:stop].to(dtype))
        send.append(pieces)
    counts = [sum(_size(numels[i], group, group.rank) for i in range(len(numels)) if owner[i] == source)
              for source in range(group.size)]
    received = exchange(send, counts, group, dtype, device)
    out: list[Tensor] = [torch.empty(0)] * len(numels)
    for source, chunk in enumerate(received):
        offset = 0
        for i in (i for i in range(len(numels)) if owner[i] == source):
            n = _size(numels[i], group, group.rank)
            out[i] = chunk[offset:offset + n]
            offset += n
    return out
