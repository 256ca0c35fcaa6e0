"""How a parameter is split over the tensor-parallel group, and the inverse.

One :class:`ShardSpec` per sharded parameter drives every conversion between the single-device
tensor and a rank's shard: slicing when a model is rewritten, gathering for a checkpoint or a
gradient comparison, and slicing again when a checkpoint is loaded. The spec is stored on the
parameter (the sharded role of :mod:`lightning_seqpar.roles`), Megatron's ``param.partition_dim`` done as one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.roles import set_sequence_parallel, set_shard_spec, shard_spec
from lightning_seqpar.tensor_parallel.collectives import ParallelGroup


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
    """

    dim: int
    full_size: int
    padded_size: int
    chunks: int = 1

    def shard(self, full: Tensor, group: ParallelGroup) -> Tensor:
        """Single-device tensor → this rank's shard (a new contiguous tensor)."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"Expected size {self.full_size} in dim {self.dim}, got shape {tuple(full.shape)}.")
        padded = self._pad(full)
        pieces = padded.chunk(self.chunks, dim=self.dim)
        local = [p.chunk(group.size, dim=self.dim)[group.rank] for p in pieces]
        return torch.cat(local, dim=self.dim).contiguous()

    def unshard(self, shards: list[Tensor]) -> Tensor:
        """Every rank's shard, in rank order → the single-device tensor."""
        per_rank = [s.chunk(self.chunks, dim=self.dim) for s in shards]
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
        chunk_full, chunk_padded = self.full_size // self.chunks, self.padded_size // self.chunks
        per_rank = chunk_padded // group.size
        ranges = []
        for c in range(self.chunks):
            start = group.rank * per_rank
            stop = min(start + per_rank, chunk_full)
            ranges.append((c * chunk_full + min(start, chunk_full), c * chunk_full + max(stop, min(start, chunk_full))))
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
