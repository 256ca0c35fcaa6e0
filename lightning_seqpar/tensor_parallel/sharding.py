"""How a parameter is split over the tensor-parallel group, and the inverse.

One :class:`ShardSpec` per sharded parameter drives every conversion between the single-device
tensor and a rank's shard: slicing when a model is rewritten, gathering for a checkpoint or a
gradient comparison, and slicing again when a checkpoint is loaded. The spec is stored on the
parameter, Megatron's ``param.partition_dim`` done as one object.

Parameter roles: one record per parameter (:class:`ParameterRoles`, Megatron-LM's ``param.partition_dim``,
``param.sequence_parallel`` and its embedding group as one object), written and read through the functions below only;
a parameter made from another (leaving the meta device, :func:`parameter_like`) takes the record with it:

* sharded (:func:`shard_spec`): split over the tensor-parallel group as its ``ShardSpec`` says.
  Checkpoints gather it, the gradient norm counts every shard once.
* sequence-parallel (:func:`is_sequence_parallel`): replicated over the tensor-parallel group, but
  each rank saw s/t tokens, so gradients are summed over the group (Korthikanti et al. 2022 §4.2.2).
* stage-local (:func:`is_stage_local`): held by one pipeline stage only.
* pipeline-tied (:func:`is_pipeline_tied`): one tensor held by the first and the last pipeline stage only (a
  tied embedding and LM head split apart by the pipeline): gradients summed between those two stages
  (Megatron-LM's embedding group), counted once (on the first stage) by norms and summaries.
  Every other parameter is kept on every stage and its gradient summed over the pipeline group.

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

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_seqpar._compat import sharded_tensor
from lightning_seqpar.parallel.collectives import ParallelGroup


@dataclass(frozen=True)
class ShardSpec:
    """A split of one dimension over t ranks.

    Attributes:
        dim: the split dimension (0 for column-parallel weights and embeddings, 1 for row-parallel).
        full_size: the single-device size of ``dim``.
        padded_size: ``full_size`` rounded up to a multiple of t (vocabulary padding); the padding
            rows are zeros.
        chunks: number of stacked blocks in ``dim`` that are each split separately, e.g. 3 for a fused
            ``[q; k; v]`` projection, so that rank r holds ``[q_r; k_r; v_r]``.
        chunk_sizes: the blocks' single-device sizes when they differ (``(a·d, a_kv·d, a_kv·d)`` for a fused
            projection under grouped-query attention); empty: ``chunks`` equal blocks.
    """

    dim: int
    full_size: int
    padded_size: int
    chunks: int = 1
    chunk_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.chunk_sizes and (len(self.chunk_sizes) != self.chunks or sum(self.chunk_sizes) != self.full_size
                                 or self.padded_size != self.full_size):
            raise ValueError(f"{self}: chunk_sizes must be `chunks` sizes summing to full_size, without padding.")

    @property
    def uneven(self) -> bool:
        """Whether the fused blocks differ in size (described to DCP by pieces, not by a reshape)."""
        return len(set(self.chunk_sizes)) > 1

    def blocks(self) -> tuple[int, ...]:
        """The padded single-device size of each stacked block, in order."""
        return self.chunk_sizes or (self.padded_size // self.chunks,) * self.chunks

    def shard(self, full: Tensor, group: ParallelGroup) -> Tensor:
        """Single-device tensor → this rank's shard (a new contiguous tensor)."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"Expected size {self.full_size} in dim {self.dim}, got shape {tuple(full.shape)}.")
        padded = self._pad(full)
        pieces = padded.split(list(self.blocks()), dim=self.dim)
        local = [p.chunk(group.size, dim=self.dim)[group.rank] for p in pieces]
        return torch.cat(local, dim=self.dim).contiguous()

    def unshard(self, shards: list[Tensor]) -> Tensor:
        """Every rank's shard, in rank order → the single-device tensor."""
        local_blocks = [size // len(shards) for size in self.blocks()]
        per_rank = [s.split(local_blocks, dim=self.dim) for s in shards]
        blocks = [torch.cat([pieces[c] for pieces in per_rank], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.full_size)

    def gather(self, local: Tensor, group: ParallelGroup) -> Tensor:
        """All-gather the shards of ``local`` over ``group`` and return the single-device tensor."""
        if group.size == 1:
            return self.unshard([local])
        gathered = group.all_gather(local.detach().movedim(self.dim, 0), dim=0).movedim(0, self.dim)
        return self.unshard(list(gathered.chunk(group.size, dim=self.dim)))

    def local_ranges(self, group: ParallelGroup) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of dim :attr:`dim` of the single-device tensor that make up this rank's
        shard, one per chunk, in order (rows of vocabulary padding lie past ``full_size`` and are left out)."""
        return self.rank_ranges(group.rank, group.size)

    def rank_ranges(self, rank: int, t: int) -> list[tuple[int, int]]:
        """:meth:`local_ranges` of tensor-parallel rank ``rank`` of ``t``."""
        padded = self.blocks()
        full = self.chunk_sizes or (self.full_size // self.chunks,) * self.chunks
        ranges, offset = [], 0
        for chunk_full, chunk_padded in zip(full, padded):
            per_rank = chunk_padded // t
            start = min(rank * per_rank, chunk_full)
            stop = max(min(rank * per_rank + per_rank, chunk_full), start)
            ranges.append((offset + start, offset + stop))
            offset += chunk_full
        return ranges

    def read_shard(self, read_rows, group: ParallelGroup) -> Tensor:
        """This rank's shard from ``read_rows(start, stop)``, which returns rows ``[start, stop)`` of dim
        :attr:`dim` of the single-device tensor (e.g. a safetensors slice), so that only this rank's bytes
        are read; padding rows are zeros."""
        pieces = [read_rows(start, stop) for start, stop in self.local_ranges(group)]
        local = torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]
        want = self.padded_size // group.size
        if local.shape[self.dim] < want:  # the last ranks' padding rows of the vocabulary
            pad = [0, 0] * (local.dim() - 1 - self.dim) + [0, want - local.shape[self.dim]]
            local = F.pad(local, pad)
        return local

    def _pad(self, full: Tensor) -> Tensor:
        extra = self.padded_size - self.full_size
        if extra == 0:
            return full
        pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, extra]
        return F.pad(full, pad)


@dataclass(frozen=True)
class ParameterRoles:
    """What the parallel runtime must know about one parameter (see the module docstring).

    Attributes:
        shard: how it is split over the tensor-parallel group; ``None``: replicated.
        sequence_parallel: replicated, its gradient summed over the tensor-parallel group.
        stage_local: held by one pipeline stage only.
        pipeline_tied: held by the first and the last pipeline stage only.
    """

    shard: Optional[ShardSpec] = None
    sequence_parallel: bool = False
    stage_local: bool = False
    pipeline_tied: bool = False


_NO_ROLES = ParameterRoles()
_ROLES_ATTRIBUTE = "parallel_roles"


def roles_of(param: Tensor) -> ParameterRoles:
    """``param``'s :class:`ParameterRoles` (none set: a replicated parameter of every stage)."""
    return getattr(param, _ROLES_ATTRIBUTE, _NO_ROLES)


def _update_roles(param: Tensor, **changes: object) -> None:
    setattr(param, _ROLES_ATTRIBUTE, replace(roles_of(param), **changes))


def parameter_like(old: Tensor, data: Tensor) -> torch.nn.Parameter:
    """A new ``nn.Parameter`` of ``data`` standing for ``old`` (e.g. ``old`` materialized off the meta device): same
    ``requires_grad``, same :class:`ParameterRoles`."""
    new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    if roles_of(old) is not _NO_ROLES:
        setattr(new, _ROLES_ATTRIBUTE, roles_of(old))
    return new


def shard_spec(param: Tensor) -> Optional[ShardSpec]:
    """The ``ShardSpec`` of a sharded parameter, ``None`` for a replicated one."""
    return roles_of(param).shard


def set_shard_spec(param: Tensor, spec: ShardSpec) -> None:
    """Tag ``param`` as this rank's shard of a parameter split as ``spec`` says."""
    _update_roles(param, shard=spec)


def is_sequence_parallel(param: Tensor) -> bool:
    """Whether ``param``'s gradient must be summed over the tensor-parallel group (each rank saw s/t tokens)."""
    return roles_of(param).sequence_parallel


def set_sequence_parallel(param: Tensor) -> None:
    """Tag ``param`` as sequence-parallel."""
    _update_roles(param, sequence_parallel=True)


def is_stage_local(param: Tensor) -> bool:
    """Whether ``param`` belongs to one pipeline stage's layers (not shared by every stage)."""
    return roles_of(param).stage_local


def set_stage_local(param: Tensor) -> None:
    """Tag ``param`` as held by one pipeline stage only."""
    _update_roles(param, stage_local=True)


def is_pipeline_tied(param: Tensor) -> bool:
    """Whether ``param`` is held by the first and the last pipeline stage only (see the module docstring)."""
    return roles_of(param).pipeline_tied


def set_pipeline_tied(param: Tensor) -> None:
    """Tag ``param`` as held by the first and the last pipeline stage only."""
    _update_roles(param, pipeline_tied=True)


def counted_on_stage(param: Tensor, pipeline_rank: int) -> bool:
    """Whether this stage counts ``param`` among the parameters summed over the pipeline group (gradient norms,
    parameter counts): a stage-local one on its stage, a pipeline-tied one on the first stage."""
    return is_stage_local(param) or (is_pipeline_tied(param) and pipeline_rank == 0)


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


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
    """The single-device shape of this rank's ``tensor``: a sharded parameter's full size in its split dim
    (vocabulary padding excluded), any other tensor's own shape."""
    spec = shard_spec(tensor)
    shape = list(tensor.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def load_from_full(target: Tensor, full, group: ParallelGroup) -> None:
    """Copy the single-device ``full`` into this rank's ``target``, in place: its slice if ``target`` is a
    sharded parameter, all of it otherwise (cast to ``target``'s device and dtype).

    ``full`` is a tensor, or a lazy reader of one (``.rows(dim, start, stop)`` and ``.read()``, e.g. a tensor of
    a safetensors file), of which only this rank's rows are read.
    """
    spec = shard_spec(target)
    if not isinstance(full, Tensor):
        value = (spec.read_shard(lambda start, stop: full.rows(spec.dim, start, stop), group) if spec is not None
                 else full.read())
    else:
        value = spec.shard(full, group) if spec is not None else full
    with torch.no_grad():
        target.copy_(value.to(target.device, target.dtype))


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


def dcp_view(local: Tensor, spec: Optional[ShardSpec], tp_mesh: Optional[DeviceMesh]) -> Tensor:
    """This rank's ``local`` tensor as DCP must see it: a plain tensor when it is replicated, otherwise a
    ``DTensor`` over ``tp_mesh`` whose global shape is :func:`saved_shape` and whose local part is a view of
    ``local`` (``[full/t, ...]``-sized; vocabulary padding cut off).

    Raises:
        ValueError: a spec whose padding is not the ``ceil(full/t)`` rows per rank DTensor's split assumes,
            or one both fused and padded.
    """
    data = local.detach()
    if spec is None:
        return data
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
