"""Whole matrices out of shards, each to one owner rank and back: what an optimizer that reads a whole matrix
(Muon's Newton–Schulz orthogonalisation) needs under tensor and expert-tensor parallelism.

Every rank of a group holds a piece of each matrix split over it (``[n/t, m]`` or ``[n, m/t]``, a
:class:`~lightning_seqpar.parallel.placement.ShardSpec`), or the whole of a matrix replicated over it. One rank per
matrix, its *owner*, receives the pieces, assembles the single-device matrix (padding dropped, fused blocks in their
single-device order), runs the function on it, and sends each rank its piece of the result (a replicated matrix's
owner sends the whole result to the others). Owners are chosen from the shapes alone, largest matrix first to the
least-loaded rank (loads in Newton–Schulz FLOPs, ``∝ rows · cols · min(rows, cols)``), so every rank agrees without
communicating. Two ``all_to_all_v`` per group and step carry it all, whatever the number of matrices; their split
sizes follow from the shapes on every rank (no host read of a size). Megatron-Core's distributed Muon
(``emerging_optimizers``' layer-wise distribution) is the model; the pieces travel in the function's own input dtype
(bfloat16 for Newton–Schulz), so that the owner's matrix is bit for bit the one a single process would form.

Bytes that leave the ranks of one group per step (``all_to_all_v``, own pieces excluded): a split matrix of shard
``N/t`` elements moves ``(t − 1)·N/t`` elements to its owner and as many back; a replicated one ``(t − 1)·N`` back
only (:func:`exchange_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.placement import ShardSpec


class _Rank(NamedTuple):
    """A rank of a group by number, for :meth:`ShardSpec.shard` to cut the piece of a rank other than this one."""

    size: int
    rank: int


@dataclass(frozen=True)
class Matrix:
    """One matrix (or a stack of them: experts' ``[E/ep, n, m]``) to be processed whole.

    Attributes:
        local: this rank's piece, ``[..., n, m]`` or a piece of it along ``spec.dim``.
        spec: the split of one of the last two dims over the group; ``None``: whole on every rank of the group.
    """

    local: Tensor
    spec: Optional[ShardSpec]

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local.shape)
        if self.spec is not None:
            shape[self.spec.dim] = self.spec.full_size
        return tuple(shape)

    def cost(self) -> float:
        """Newton–Schulz FLOPs up to a constant: ``rows · cols · min(rows, cols)`` per matrix of the stack."""
        *stack, rows, cols = self.full_shape()
        count = 1
        for size in stack:
            count *= size
        return float(count * rows * cols * min(rows, cols))


def owners(matrices: Sequence[Matrix], size: int) -> list[int]:
    """The owner rank of each of ``matrices`` on a group of ``size`` ranks: largest first to the least-loaded rank
    (the lowest rank among equals); the same answer on every rank, from the shapes alone."""
    load = [0.0] * size
    out = [0] * len(matrices)
    for index in sorted(range(len(matrices)), key=lambda i: (-matrices[i].cost(), i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        out[index] = rank
        load[rank] += matrices[index].cost()
    return out


def exchange_bytes(matrices: Sequence[Matrix], size: int, element_size: int) -> int:
    """Bytes leaving the ranks of a group of ``size`` ranks, in all, in one :func:`process_whole` over
    ``matrices`` (see the module), in pieces of ``element_size`` bytes."""
    if size == 1:
        return 0
    elements = sum(2 * (size - 1) * m.local.numel() if m.spec is not None else (size - 1) * m.local.numel()
                   for m in matrices)
    return elements * element_size


def process_whole(matrices: Sequence[Matrix], group: ParallelGroup, function: Callable[[Tensor], Tensor],
                  dtype: torch.dtype) -> list[Tensor]:
    """``function`` of each single-device matrix, run once on its owner (:func:`owners`), as this rank's piece of
    the result (the shape of ``matrix.local``, ``dtype``). Collective over ``group``: every rank passes the same
    matrices in the same order (its own pieces of them).

    Raises:
        ValueError: a matrix split along a dim other than its last two (a split of a stack is not a matrix split).
    """
    for m in matrices:
        if m.spec is not None and m.spec.dim < m.local.dim() - 2:
            raise ValueError(f"A matrix split along dim {m.spec.dim} of {tuple(m.local.shape)}: only the last two "
                             f"dims of a matrix (stack) are gathered whole.")
    size, rank = group.size, group.rank
    if not matrices:
        return []
    if size == 1:
        return [_piece(function(_assemble(m, [m.local.to(dtype)])), m, _Rank(1, 0)) for m in matrices]
    owner = owners(matrices, size)
    mine = [i for i, o in enumerate(owner) if o == rank]
    split = [i for i, m in enumerate(matrices) if m.spec is not None]

    # to the owners: each rank's piece of every split matrix
    send = [[matrices[i].local.to(dtype).reshape(-1) for i in split if owner[i] == dest] for dest in range(size)]
    per_source = sum(matrices[i].local.numel() for i in split if owner[i] == rank)
    received = exchange(send, [per_source] * size, group, dtype, matrices[0].local.device, bool(split))
    pieces = {i: [] for i in split if owner[i] == rank}
    for chunk in received:
        offset = 0
        for i in (i for i in split if owner[i] == rank):
            n = matrices[i].local.numel()
            pieces[i].append(chunk[offset:offset + n].view(matrices[i].local.shape))
            offset += n

    results = {i: function(_assemble(matrices[i], pieces[i]) if i in pieces else matrices[i].local.to(dtype))
               for i in mine}

    # back from the owners: each rank's piece of every result (a replicated matrix's result whole)
    send = [[_piece(results[i], matrices[i], _Rank(size, dest)).to(dtype).reshape(-1) for i in mine]
            for dest in range(size)]
    counts = [sum(matrices[i].local.numel() for i, o in enumerate(owner) if o == source) for source in range(size)]
    received = exchange(send, counts, group, dtype, matrices[0].local.device, bool(matrices))
    out: list[Optional[Tensor]] = [None] * len(matrices)
    for source, chunk in enumerate(received):
        offset = 0
        for i in (i for i, o in enumerate(owner) if o == source):
            n = matrices[i].local.numel()
            out[i] = chunk[offset:offset + n].view(matrices[i].local.shape)
            offset += n
    return out  # type: ignore[return-value]


def _assemble(matrix: Matrix, pieces: list[Tensor]) -> Tensor:
    """The single-device matrix from every rank's piece (rank order); a replicated matrix is its one piece."""
    return pieces[0] if matrix.spec is None else matrix.spec.unshard(pieces)


def _piece(result: Tensor, matrix: Matrix, rank: _Rank) -> Tensor:
    """Rank ``rank``'s piece of the single-device ``result`` (the whole of it for a replicated matrix)."""
    return result if matrix.spec is None else matrix.spec.shard(result, rank)  # type: ignore[arg-type]


def exchange(send: list[list[Tensor]], recv_counts: list[int], group: ParallelGroup, dtype: torch.dtype,
             device: torch.device, needed: bool = True) -> list[Tensor]:
    """One ``all_to_all_v`` of flat pieces: ``send[dest]`` to rank ``dest``; ``recv_counts[source]`` elements from
    each rank, returned per source. ``needed``: whether any rank sends anything, which every rank must answer alike
    (from the tensors' list, not from its own counts) for the collective to match."""
    if not needed:
        return [torch.empty(0, dtype=dtype, device=device) for _ in range(group.size)]
    send_counts = [sum(t.numel() for t in pieces) for pieces in send]
    every = [t for pieces in send for t in pieces]
    flat = torch.cat(every) if every else torch.empty(0, dtype=dtype, device=device)
    out = group.all_to_all_v(flat, send_counts, recv_counts)
    return list(out.split(recv_counts))
