"""Where a parameter lives and how its gradient is made whole: one record per parameter, naming mesh groups.

A :class:`Placement` is Megatron-LM's ``param.partition_dim``, ``param.sequence_parallel``, ``param.allreduce``
(expert or not) and its embedding group as one value, and the only thing a consumer of parameters reads to know
which groups to communicate over: gradient buckets and finalization, the distributed optimizer's element ranges, the
gradient norm, checkpoint views, summaries. Each field names groups of the mesh
(:data:`~lightning_seqpar.parallel.dims.GROUPS`), so a parameter reduced over another group (an expert's, over
expert data parallel) needs a record, not a code path.

* ``shard``/``shard_over``: the tensor is split along ``shard.dim`` over group ``shard_over`` (a
  :class:`ShardSpec`; tensor parallel for the parallel layers). Checkpoints gather it, the gradient norm counts every
  shard once.
* ``inner``/``inner_over``: a second split, of the shard, along another dimension over another group (an expert's
  width over expert tensor parallelism, ``etp``, inside its split over ``ep``: Megatron-Core's expert tensor
  parallelism). Gathering undoes ``inner`` first, then ``shard``.
* ``partial_over``: groups whose ranks each computed part of the gradient from their own tokens, summed over them
  (sequence-parallel weights over ``tp``: each rank saw s/t tokens, Korthikanti et al. 2022 §4.2.2).
* ``replicated_over``: the group of data replicas holding the same values, over which the gradient is summed and then
  divided by the number of data replicas d·c (``dp_cp`` for dense weights; ``edp`` for experts, whose tokens came
  from every replica of their expert-parallel group: Megatron-Core's expert gradient scaling).
* ``stage``: ``"shared"`` (every pipeline stage holds a copy: gradients summed over ``pp``), ``"local"`` (one
  stage's layers) or ``"tied"`` (the first and the last stage only, a tied embedding and LM head: summed between
  them, Megatron-LM's embedding group; counted once, on the first stage, by norms and summaries).

A parameter made from another (leaving the meta device, :func:`parameter_like`) takes the record with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.dims import GROUPS

STAGES = ("shared", "local", "tied")
SHARD_GROUPS = ("tp", "etp", "ep")
"""The groups a parameter can be split over (splitting over data replicas is the distributed optimizer's)."""
REPLICA_GROUPS = ("dp_cp", "edp")
"""The groups of data replicas: dense weights', experts'."""


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
class ShardGrid:
    """Where the parts of a tensor split twice live (``Placement.inner``: an expert's width over ``etp`` inside its
    split over ``ep``): ``ranks[a][b]``, the global rank at rank ``a`` of the outer group and ``b`` of the inner one;
    this rank's ``(outer_rank, inner_rank)``."""

    ranks: tuple[tuple[int, ...], ...]
    outer_rank: int
    inner_rank: int


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives and which groups finish its gradient (see the module docstring).

    Attributes:
        shard: how it is split over ``shard_over``; ``None``: replicated there.
        shard_over: the group ``shard`` splits it over.
        inner: how the shard is split again over ``inner_over`` (along another dimension); ``None``: not.
        inner_over: the group ``inner`` splits it over.
        partial_over: groups over which its gradient is summed (each rank saw part of the tokens).
        replicated_over: the data replicas: gradient summed over them, divided by d·c.
        stage: ``"shared"``, ``"local"`` or ``"tied"`` (pipeline stages).

    Raises:
        ValueError: ``shard_over`` or ``inner_over`` not in :data:`SHARD_GROUPS`, ``replicated_over`` not in
            :data:`REPLICA_GROUPS`, a ``partial_over`` name not in :data:`~lightning_seqpar.parallel.dims.GROUPS`, an
            unknown stage, or an ``inner`` split without an outer one, along its dimension or over its group.
    """

    shard: Optional[ShardSpec] = None
    shard_over: str = "tp"
    partial_over: tuple[str, ...] = ()
    replicated_over: str = "dp_cp"
    stage: str = "shared"
    inner: Optional[ShardSpec] = None
    inner_over: str = "etp"

    def __post_init__(self) -> None:
        if self.inner is not None and (self.shard is None or self.inner.dim == self.shard.dim
                                       or self.inner_over == self.shard_over):
            raise ValueError(f"Placement splits {self.inner} over {self.inner_over!r} inside {self.shard} over "
                             f"{self.shard_over!r}: an inner split needs an outer one, along another dimension, over "
                             f"another group.")
        for name, allowed in ((self.shard_over, SHARD_GROUPS), (self.inner_over, SHARD_GROUPS),
                              (self.replicated_over, REPLICA_GROUPS),
                              *((name, tuple(GROUPS)) for name in self.partial_over)):
            if name not in allowed:
                raise ValueError(f"Placement names group {name!r} where one of {list(allowed)} belongs.")
        if self.stage not in STAGES:
            raise ValueError(f"Placement stage {self.stage!r}: one of {STAGES}.")

    @property
    def stage_group(self) -> Optional[str]:
        """The group over which pipeline stages' parts of the gradient are summed: ``"pp"`` for a parameter every
        stage holds, ``"embedding"`` (the first and the last stage) for a tied one, ``None`` for a stage's own."""
        return {"shared": "pp", "tied": "embedding", "local": None}[self.stage]

    def counted_on(self, pipeline_rank: int) -> bool:
        """Whether this pipeline stage counts the parameter in whole-model sums (norms, parameter counts): not a
        tied parameter's copy on the last stage."""
        return self.stage != "tied" or pipeline_rank == 0

    def norm_groups(self, pipeline_rank: int, data_parallel_parts: bool = False) -> tuple[str, ...]:
        """The groups whose ranks hold distinct parts of this parameter's finished gradient, whose partial sums a
        whole-model norm adds up: ``shard_over`` if sharded, ``pp`` for a stage's own parameter (a tied one counted on
        the first stage), ``replicated_over`` when each replica holds an element range (the distributed optimizer).
        Sorted by name."""
        groups = set()
        if self.shard is not None:
            groups.add(self.shard_over)
        if self.inner is not None:
            groups.add(self.inner_over)
        if self.stage == "local" or (self.stage == "tied" and pipeline_rank == 0):
            groups.add("pp")
        if data_parallel_parts:
            groups.add(self.replicated_over)
        return tuple(sorted(groups))


_REPLICATED = Placement()
_ATTRIBUTE = "parallel_placement"


def placement_of(param: Tensor) -> Placement:
    """``param``'s :class:`Placement` (none set: replicated over ``dp_cp``, on every stage)."""
    return getattr(param, _ATTRIBUTE, _REPLICATED)


def place(param: Tensor, **changes: object) -> None:
    """Change fields of ``param``'s :class:`Placement` (e.g. ``place(w, replicated_over="edp")``).

    Raises:
        ValueError: from :class:`Placement`.
    """
    setattr(param, _ATTRIBUTE, replace(placement_of(param), **changes))


def parameter_like(old: Tensor, data: Tensor) -> torch.nn.Parameter:
    """A new ``nn.Parameter`` of ``data`` standing for ``old`` (e.g. ``old`` materialized off the meta device): same
    ``requires_grad``, same :class:`Placement`."""
    new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    if placement_of(old) is not _REPLICATED:
        setattr(new, _ATTRIBUTE, placement_of(old))
    return new


def shard_spec(param: Tensor) -> Optional[ShardSpec]:
    """The ``ShardSpec`` of a sharded parameter, ``None`` for a replicated one."""
    return placement_of(param).shard


def inner_spec(param: Tensor) -> Optional[ShardSpec]:
    """The ``ShardSpec`` of a shard's second split (``Placement.inner``), ``None`` for a parameter split once or not."""
    return placement_of(param).inner


def set_shard_spec(param: Tensor, spec: ShardSpec, over: str = "tp") -> None:
    """Tag ``param`` as this rank's shard, over group ``over``, of a parameter split as ``spec`` says."""
    place(param, shard=spec, shard_over=over)


def is_sequence_parallel(param: Tensor) -> bool:
    """Whether ``param``'s gradient must be summed over the tensor-parallel group (each rank saw s/t tokens)."""
    return "tp" in placement_of(param).partial_over


def set_sequence_parallel(param: Tensor) -> None:
    """Tag ``param`` as sequence-parallel: its gradient summed over ``tp``."""
    partial = placement_of(param).partial_over
    if "tp" not in partial:
        place(param, partial_over=(*partial, "tp"))


def is_stage_local(param: Tensor) -> bool:
    """Whether ``param`` belongs to one pipeline stage's layers (not shared by every stage)."""
    return placement_of(param).stage == "local"


def set_stage_local(param: Tensor) -> None:
    """Tag ``param`` as held by one pipeline stage only."""
    place(param, stage="local")


def is_pipeline_tied(param: Tensor) -> bool:
    """Whether ``param`` is held by the first and the last pipeline stage only (see the module docstring)."""
    return placement_of(param).stage == "tied"


def set_pipeline_tied(param: Tensor) -> None:
    """Tag ``param`` as held by the first and the last pipeline stage only."""
    place(param, stage="tied")


def counted_on_stage(param: Tensor, pipeline_rank: int) -> bool:
    """Whether this stage counts ``param`` among the parameters summed over the pipeline group (gradient norms,
    parameter counts): a stage-local one on its stage, a pipeline-tied one on the first stage."""
    return is_stage_local(param) or (is_pipeline_tied(param) and pipeline_rank == 0)
