"""An element range of a parameter's state described to ``torch.distributed.checkpoint`` (DCP) in place.

The distributed optimizer (ZeRO-1) keeps, on data-parallel rank j, elements ``[start_j, stop_j)`` of each parameter's
local shard, flattened. DCP reshards by rectangular chunks of a tensor's global shape (:func:`~.sharding.saved_shape`,
the single-device tensor). A contiguous element range of a row-major tensor is a few such chunks (at most two per
dimension, :func:`range_boxes`), each a contiguous piece of the range's memory. So the range is written and read
where it lives, by its owner, under the same key and global shape as an unsharded optimizer's state: a checkpoint
written under either ``zero`` resumes under the other, or under another data-parallel size, and no rank assembles
another's state. Vocabulary padding rows are left out, as :func:`~.sharding.dcp_view` leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from torch import Tensor

from lightning_seqpar._compat import sharded_tensor
from lightning_seqpar.tensor_parallel.sharding import full_shape, saved_shape
from lightning_seqpar.parallel.placement import shard_spec

MAIN_PARAM = "main_param"
"""The optimizer-state key of a parameter's float32 main copy (the distributed optimizer's main params); an optimizer
that updates the parameters themselves skips it on load."""

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(offsets, sizes, flat start)`` of a chunk of a row-major tensor."""


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangular chunks, in order, each
    contiguous in memory: ``(offsets, sizes, flat offset of its first element)``."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        sub = range_boxes(shape[1:], start - first * inner, stop - first * inner)
        return [((first, *o), (1, *s), first * inner + f) for o, s, f in sub]
    boxes: list[Box] = []
    lo, hi = first, last + 1  # whole rows [lo, hi) unless the ends are partial
    if start % inner:
        boxes += [((first, *o), (1, *s), first * inner + f) for o, s, f in range_boxes(shape[1:], start % inner, inner)]
        lo = first + 1
    tail = []
    if stop % inner:
        tail = [((last, *o), (1, *s), last * inner + f) for o, s, f in range_boxes(shape[1:], 0, stop % inner)]
        hi = last
    if hi > lo:
        boxes.append(((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]), lo * inner))
    return boxes + tail


@dataclass(frozen=True)
class RangeLayout:
    """Where a parameter's element ranges live: this rank's coordinates in the group its shards are split over
    (``tp`` for the parallel layers) and in the group of its replicas (``dp_cp``, ``edp`` for experts), and the
    global rank of every ``(replica, shard)`` coordinate of its pipeline stage.

    Attributes:
        tp_rank, dp_rank: this rank's rank among the shards and among the replicas.
        ranks: ``ranks[j][i]``: the global rank at replica j, shard i.
    """

    tp_rank: int
    dp_rank: int
    ranks: tuple[tuple[int, ...], ...]

    @property
    def tp(self) -> int:
        return len(self.ranks[0])

    @property
    def dp(self) -> int:
        return len(self.ranks)


def _owned(numel: int, d: int, j: int) -> tuple[int, int]:
    k = -(-numel // d)
    return min(j * k, numel), min((j + 1) * k, numel)


def _chunks(param: Tensor, tp_rank: int, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The global chunks ``(offsets, sizes, flat start in the local shard)`` of elements ``[start, stop)`` of
    ``param``'s shard on tensor-parallel rank ``tp_rank`` (padding rows left out)."""
    spec = shard_spec(param)
    shape = list(param.shape)
    if spec is not None and spec.uneven:
        return _piece_chunks(param, tp_rank, start, stop)
    dim, keep, offset = None, None, 0
    if spec is not None:
        dim = spec.dim
        per_rank = shape[dim]
        if spec.chunks > 1:
            shape[dim:dim + 1] = [spec.chunks, per_rank // spec.chunks]
            dim += 1
            per_rank = shape[dim]
        keep = min(max(spec.full_size // spec.chunks - tp_rank * per_rank, 0), per_rank)
        offset = tp_rank * per_rank
    out = []
    for offsets, sizes, flat in range_boxes(shape, start, stop):
        offsets, sizes = list(offsets), list(sizes)
        if dim is not None:
            end = min(offsets[dim] + sizes[dim], keep)
            if end <= offsets[dim]:
                continue  # padding rows only
            if end < offsets[dim] + sizes[dim]:
                if any(sizes[k] != 1 for k in range(dim)):  # the cut piece would not be contiguous
                    raise ValueError(f"Cannot cut the padding out of a range of a {tuple(param.shape)} shard in one "
                                     f"piece (split dim {spec.dim}).")
                sizes[dim] = end - offsets[dim]
            offsets[dim] += offset
        out.append((tuple(offsets), tuple(sizes), flat))
    return out


def _piece_chunks(param: Tensor, tp_rank: int, start: int, stop: int) -> list[Box]:
    """:func:`_chunks` of a shard of unequal fused blocks (split along dim 0): each block's rows of the local shard are
    one run of rows of the single-device tensor, cut into boxes on its own."""
    spec = shard_spec(param)
    assert spec is not None
    rest = tuple(param.shape[1:])
    inner = _volume(rest)
    out: list[Box] = []
    row = 0
    for first, last in spec.rank_ranges(tp_rank, spec.full_size // param.shape[0]):
        rows = last - first
        lo, hi = max(start, row * inner), min(stop, (row + rows) * inner)
        for offsets, sizes, flat in range_boxes((rows, *rest), lo - row * inner, hi - row * inner):
            out.append(((offsets[0] + first, *offsets[1:]), sizes, flat + row * inner))
        row += rows
    return out


def dcp_range_view(piece: Tensor, param: Tensor, layout: RangeLayout) -> Any:
    """``piece`` (``[stop - start]``, this data-parallel rank's elements of a state tensor shaped like ``param``'s
    local shard) as DCP must see it: a ``ShardedTensor`` of :func:`~.sharding.saved_shape` whose pieces are views of
    ``piece`` (writing or loading it reads or fills ``piece`` in place), its global metadata every rank's range of
    every tensor-parallel shard (only this rank's own tensor-parallel shard when ``param`` is replicated: its copies
    are the same, DCP writes one).

    Raises:
        ValueError: a padded shard whose padding a range cannot leave out in one piece.
    """
    numel = param.numel()
    start, stop = _owned(numel, layout.dp, layout.dp_rank)
    if piece.numel() != stop - start:
        raise ValueError(f"A range of {piece.numel()} elements for elements [{start}, {stop}) of a {tuple(param.shape)}.")
    sharded = shard_spec(param) is not None
    flat = piece.reshape(-1)
    local = [(flat[f - start:f - start + _volume(sizes)].view(sizes), list(offsets))
             for offsets, sizes, f in _chunks(param, layout.tp_rank, start, stop)]
    placed = []
    for j in range(layout.dp):
        lo, hi = _owned(numel, layout.dp, j)
        for i in (range(layout.tp) if sharded else [layout.tp_rank]):
            placed += [(list(o), list(s), layout.ranks[j][i]) for o, s, _ in _chunks(param, i, lo, hi)]
    size = list(saved_shape(shard_spec(param), full_shape(param)))
    return sharded_tensor(local, placed, size, piece.dtype)


def _volume(sizes: Sequence[int]) -> int:
    volume = 1
    for size in sizes:
        volume *= size
    return volume


def range_layout(mesh: Any, replicas: str, shard_over: Optional[str]) -> RangeLayout:
    """The :class:`RangeLayout` of this rank for a parameter whose element ranges are split over group ``replicas``
    of ``mesh`` (a :class:`~lightning_seqpar.parallel.mesh.ParallelMesh`) and whose shards over group ``shard_over``
    (``None``: not sharded; one column, this rank's own)."""
    import torch.distributed as dist

    if shard_over is None:
        ranks = tuple((r,) for r in mesh.dims.group_of(replicas, dist.get_rank()))
        return RangeLayout(0, mesh.group(replicas).rank, ranks)
    return RangeLayout(mesh.group(shard_over).rank, mesh.group(replicas).rank, mesh.ranks_of(replicas, shard_over))
