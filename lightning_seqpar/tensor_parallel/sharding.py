"""How a parameter is split over a group, and the inverse: slicing, gathering, and views for checkpoints.

A :class:`~lightning_seqpar.parallel.placement.ShardSpec` (a split of one dimension) and the parameter's
:class:`~lightning_seqpar.parallel.placement.Placement` (which group splits it, which groups finish its gradient) live
with the mesh in :mod:`lightning_seqpar.parallel.placement`, where the layers import them from.

How a shard is described to ``torch.distributed.checkpoint`` (DCP): global shape and offset
(:func:`dcp_view`, :func:`saved_shape`).

DCP reshards on load when every saved and loaded tensor says which part of the global tensor it is.
A sharded parameter (and each optimizer state tensor shaped like it) becomes a ``DTensor`` view of the
live local shard over the tensor-parallel device mesh, ``[Shard(dim)]``; everything else is a plain
tensor, replicated, which DCP writes once (its deduplication picks one writer per identical piece).
Views, not copies: loading writes straight into the model's and optimizer's memory.

Two layouts of :class:`ShardSpec` need care:

- Vocabulary padding: rank r holds rows ``[r·c, (r+1)·c)`` of the padded table, ``c = padded/t``; the rows
  past ``full_size`` are left out, so the checkpoint holds the single-device table and the shards are
  ``torch.chunk``'s uneven split, which is DTensor's.
- Fused blocks (``chunks`` k, e.g. ``[q; k; v]``): rank r holds ``[q_r; k_r; v_r]``, k separate pieces of
  the ``[k·n, ...]`` tensor. The global tensor is stored as ``[k, n, ...]`` (a view of the same memory) and
  split along the second dim, a contiguous shard again; :func:`saved_shape` gives that shape, and the
  single-device shape is restored by a reshape (checkpoints record it).
- Fused blocks of unequal sizes (``chunk_sizes``, e.g. ``[q; k; v]`` of grouped-query attention, q ``a·d`` rows and
  k, v ``a_kv·d`` each): no reshape makes rank r's ``[q_r; k_r; v_r]`` one rectangle, so the global tensor keeps
  its single-device shape and the shard is described as k pieces of it (a ``ShardedTensor``, which DCP reads and
  writes by arbitrary chunks); split along dim 0 only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_seqpar._compat import sharded_tensor
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.placement import (
    ShardGrid, ShardSpec, inner_spec, set_sequence_parallel, set_shard_spec, shard_spec,
)


ShardMeshes = Callable[[Tensor], Union[DeviceMesh, ShardGrid, None]]
"""A parameter → the one-dimensional device mesh of the group its shard is split over (``None``: not split there), or
the :class:`ShardGrid` of a parameter split twice; :meth:`~lightning_seqpar.parallel.mesh.ParallelMesh.
shard_device_mesh` for a built mesh."""


def shard_parameter(full: Tensor, spec: ShardSpec, group: ParallelGroup, *, sequence_parallel: bool = False):
    """A new ``nn.Parameter`` holding this rank's shard of ``full``, tagged with ``spec``."""
    param = torch.nn.Parameter(spec.shard(full.detach(), group), requires_grad=full.requires_grad)
    set_shard_spec(param, spec)
    if sequence_parallel:
        set_sequence_parallel(param)
    return param


def init_shard(full_shape: tuple[int, ...], spec: ShardSpec, group: ParallelGroup, std: float = 0.02):
    """A new parameter holding this rank's shard of one single-device ``normal_(0, std)`` draw of ``full_shape``
    (Megatron-LM's ``init_method_normal``), tagged with ``spec``.

    The whole tensor is drawn from the default generator (seeded alike on every tensor-parallel rank) and sliced,
    as Megatron-LM's ``_initialize_affine_weight_cpu`` does: the shards differ from rank to rank and gathered they
    are what one device draws with the same seed, whatever t. On the meta device nothing is drawn.
    """
    full = torch.empty(full_shape)
    if not full.is_meta:
        full.normal_(std=std)
    return shard_parameter(full, spec, group)


def mark_sequence_parallel(module: torch.nn.Module) -> None:
    """Tag a module's own parameters as sequence-parallel: replicated, but each rank sees s/t tokens,
    so their gradients must be summed over the tensor-parallel group (Megatron-LM
    ``_allreduce_layernorm_grads``)."""
    for param in module.parameters(recurse=False):
        set_sequence_parallel(param)


def full_shape(tensor: Tensor) -> tuple[int, ...]:
    """The single-device shape of this rank's ``tensor``: a sharded parameter's full size in its split dims
    (vocabulary padding excluded), any other tensor's own shape."""
    shape = list(tensor.shape)
    for spec in (shard_spec(tensor), inner_spec(tensor)):
        if spec is not None:
            shape[spec.dim] = spec.full_size
    return tuple(shape)


def load_from_full(target: Tensor, full, group: ParallelGroup, inner_group: Optional[ParallelGroup] = None) -> None:
    """Copy the single-device ``full`` into this rank's ``target``, in place: its slice if ``target`` is a
    sharded parameter (over ``group``, then over ``inner_group`` where its placement splits it twice), all of it
    otherwise (cast to ``target``'s device and dtype).

    ``full`` is a tensor, or a lazy reader of one (``.rows(dim, start, stop)`` and ``.read()``, e.g. a tensor of
    a safetensors file), of which only this rank's rows (of the outer split) are read.

    Raises:
        ValueError: a parameter split twice and no ``inner_group``.
    """
    spec, inner = shard_spec(target), inner_spec(target)
    if not isinstance(full, Tensor):
        value = (spec.read_shard(lambda start, stop: full.rows(spec.dim, start, stop), group) if spec is not None
                 else full.read())
    else:
        value = spec.shard(full, group) if spec is not None else full
    if inner is not None:
        if inner_group is None:
            raise ValueError(f"A parameter split twice ({spec} then {inner}) needs the group of its second split.")
        value = inner.shard(value, inner_group)
    with torch.no_grad():
        target.copy_(value.to(target.device, target.dtype))


def gather_full(local: Tensor, spec: Optional[ShardSpec], group: ParallelGroup, inner: Optional[ShardSpec] = None,
                inner_group: Optional[ParallelGroup] = None) -> Tensor:
    """The single-device tensor of which ``local`` (a parameter's shard, or a tensor shaped like it) is this rank's
    part: gathered over ``inner_group`` along ``inner`` first, then over ``group`` along ``spec`` (collective over
    both). ``spec`` ``None``: ``local`` itself.

    Raises:
        ValueError: ``inner`` without ``inner_group``.
    """
    value = local.detach()
    if inner is not None:
        if inner_group is None:
            raise ValueError(f"A tensor split twice ({spec} then {inner}) needs the group of its second split.")
        value = inner.gather(value, inner_group)
    return spec.gather(value, group) if spec is not None else value


def saved_shape(spec: Optional[ShardSpec], single_device_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape under which a tensor of ``single_device_shape`` sharded by ``spec`` is saved."""
    shape = list(single_device_shape)
    if spec is not None and spec.chunks > 1 and not spec.uneven:
        shape[spec.dim:spec.dim + 1] = [spec.chunks, spec.full_size // spec.chunks]
    return tuple(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def dcp_view(local: Tensor, spec: Optional[ShardSpec], tp_mesh: Union[DeviceMesh, ShardGrid, None],
             inner: Optional[ShardSpec] = None) -> Tensor:
    """This rank's ``local`` tensor as DCP must see it: a plain tensor when it is replicated, otherwise a
    ``DTensor`` over ``tp_mesh`` whose global shape is :func:`saved_shape` and whose local part is a view of
    ``local`` (``[full/t, ...]``-sized; vocabulary padding cut off). Split twice (``inner``, over the
    :class:`ShardGrid` ``tp_mesh``): pieces of the single-device shape (:func:`_grid_view`).

    Raises:
        ValueError: a spec whose padding is not the ``ceil(full/t)`` rows per rank DTensor's split assumes,
            or one both fused and padded; a tensor split twice without its grid, or padded.
    """
    data = local.detach()
    if spec is None:
        return data
    if inner is not None:
        if not isinstance(tp_mesh, ShardGrid):
            raise ValueError(f"A tensor split twice ({spec} then {inner}) is described by its ShardGrid, not "
                             f"{type(tp_mesh).__name__}.")
        return _grid_view(data, spec, inner, tp_mesh)
    t = 1 if tp_mesh is None else tp_mesh.size()
    rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
    if spec.uneven:
        return _pieces_view(data, spec, tp_mesh)
    if spec.padded_size != spec.full_size:
        per_rank = spec.padded_size // t
        if spec.chunks > 1 or per_rank != -(-spec.full_size // t):
            raise ValueError(
                f"Cannot describe a shard of {spec} at t={t} to torch.distributed.checkpoint: padding must give each "
                f"rank ceil(full_size/t) rows and fused blocks cannot be padded."
            )
        keep = min(max(spec.full_size - rank * per_rank, 0), per_rank)
        data = data.narrow(spec.dim, 0, keep)  # [full/t, ...]: padding rows never reach the checkpoint
    dim = spec.dim
    if spec.chunks > 1:
        data = data.unflatten(dim, (spec.chunks, -1))  # [k, n/t, ...]: one contiguous shard of [k, n, ...]
        dim += 1
    if t == 1:
        return data
    global_shape = list(data.shape)
    global_shape[dim] = spec.full_size // spec.chunks
    shape = torch.Size(global_shape)
    return DTensor.from_local(data, tp_mesh, [Shard(dim)], run_check=False, shape=shape,
                              stride=_contiguous_stride(tuple(shape)))


def _pieces_view(data: Tensor, spec: ShardSpec, tp_mesh: Optional[DeviceMesh]) -> Tensor:
    """A shard of unequal fused blocks as DCP must see it: one piece per block, each a view of its rows of ``data``,
    at its rows of the single-device tensor (no communication: every rank's rows follow from ``spec``)."""
    if spec.dim != 0:
        raise ValueError(f"Cannot describe a shard of {spec} to torch.distributed.checkpoint: fused blocks of unequal "
                         f"sizes are split along dim 0 only.")
    t = 1 if tp_mesh is None else tp_mesh.size()
    if t == 1:
        return data
    rank = tp_mesh.get_local_rank()
    size = [spec.full_size, *data.shape[1:]]
    ranks = tp_mesh.mesh.reshape(-1).tolist()
    rest = [0] * (data.dim() - 1)
    local, row = [], 0
    for start, stop in spec.rank_ranges(rank, t):
        local.append((data.narrow(0, row, stop - start), [start, *rest]))
        row += stop - start
    placed = [([start, *rest], [stop - start, *data.shape[1:]], ranks[r]) for r in range(t)
              for start, stop in spec.rank_ranges(r, t)]
    return sharded_tensor(local, placed, size, data.dtype)


def _grid_view(data: Tensor, spec: ShardSpec, inner: ShardSpec, grid: ShardGrid) -> Tensor:
    """A tensor split along ``spec.dim`` over the grid's outer group and along ``inner.dim`` over its inner group as
    DCP must see it: a ``ShardedTensor`` of the single-device shape (whatever either size, so a checkpoint reshards
    across both and reads those written before the second split existed) whose pieces are views of ``data``, each
    (outer block, inner block) cut into the runs of it that are contiguous in memory (``ShardedTensor`` takes
    contiguous pieces only: one per expert for the gate/up halves of an expert's width, the whole shard otherwise).
    Every rank's pieces follow from the specs: no communication."""
    if spec.padded_size != spec.full_size or inner.padded_size != inner.full_size:
        raise ValueError(f"Cannot describe a tensor split twice with padding ({spec}, {inner}) to "
                         f"torch.distributed.checkpoint.")
    data = data.contiguous()
    if spec.chunks > 1 and not spec.uneven:  # [k, n, ...] as split once (saved_shape): either layout reads the other
        data = data.unflatten(spec.dim, (spec.chunks, -1))
        inner = replace(inner, dim=inner.dim + 1) if inner.dim > spec.dim else inner
        spec = ShardSpec(dim=spec.dim + 1, full_size=spec.full_size // spec.chunks,
                         padded_size=spec.padded_size // spec.chunks)
    outer_size, inner_size = len(grid.ranks), len(grid.ranks[0])
    size = list(data.shape)
    size[spec.dim], size[inner.dim] = spec.full_size, inner.full_size

    def pieces(a: int, b: int) -> list[tuple[list[int], list[int], list[int]]]:
        """(global offsets, sizes, offsets in the rank's own tensor) of every contiguous piece of rank (a, b)."""
        out = []
        at_outer = 0
        for o_start, o_stop in spec.rank_ranges(a, outer_size):
            at_inner = 0
            for i_start, i_stop in inner.rank_ranges(b, inner_size):
                offsets, sizes, local = [0] * len(size), list(data.shape), [0] * len(size)
                offsets[spec.dim], sizes[spec.dim], local[spec.dim] = o_start, o_stop - o_start, at_outer
                offsets[inner.dim], sizes[inner.dim], local[inner.dim] = i_start, i_stop - i_start, at_inner
                out += _contiguous_runs(offsets, sizes, local, list(data.shape))
                at_inner += i_stop - i_start
            at_outer += o_stop - o_start
        return out

    local = []
    for offsets, sizes, at in pieces(grid.outer_rank, grid.inner_rank):
        view = data
        for dim, (start, length) in enumerate(zip(at, sizes)):
            view = view.narrow(dim, start, length)
        local.append((view, offsets))
    placed = [(offsets, sizes, grid.ranks[a][b]) for a in range(outer_size) for b in range(inner_size)
              for offsets, sizes, _ in pieces(a, b)]
    return sharded_tensor(local, placed, size, data.dtype)


def _contiguous_runs(offsets: list[int], sizes: list[int], local: list[int], shape: list[int]
                     ) -> list[tuple[list[int], list[int], list[int]]]:
    """A box (global ``offsets``, ``sizes``, at ``local`` in a row-major tensor of ``shape``) as boxes contiguous in
    that tensor: split along every dimension before the last one it does not span whole (one index each)."""
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return [(offsets, sizes, local)]
    runs = [(list(offsets), list(sizes), list(local))]
    for dim in range(partial[-1]):
        split = []
        for o, s, l in runs:
            for i in range(s[dim]):
                o2, s2, l2 = list(o), list(s), list(l)
                o2[dim], s2[dim], l2[dim] = o[dim] + i, 1, l[dim] + i
                split.append((o2, s2, l2))
        runs = split
    return runs
