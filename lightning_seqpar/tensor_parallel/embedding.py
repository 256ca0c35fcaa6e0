"""Vocabulary-parallel embedding (Megatron-LM ``VocabParallelEmbedding``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import (
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from lightning_seqpar.tensor_parallel.sharding import set_shard_spec
from lightning_seqpar.tensor_parallel.sharding import ShardSpec, padded_size, shard_parameter


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the tensor-parallel group.

    The vocabulary v is padded to a multiple of t with zero rows, so any v works. Rank r holds rows
    ``[r·v'/t, (r+1)·v'/t)`` of the padded table; a token outside that range looks up zeros, and the
    partial results are summed: by ḡ (reduce-scatter along s, entering the sequence-parallel
    region) under SP, by f̄ (all-reduce) otherwise.

    Args:
        num_embeddings: global vocabulary size v.
        embedding_dim: h.
        group: the tensor-parallel group.
        sequence_parallel: return the sequence shard ``[s/t, b, h]`` instead of ``[s, b, h]``.

    Shapes: input ids ``[b, s]`` (batch-first, as a data loader gives them); output sequence-first
    ``[s/t, b, h]`` under SP, else ``[s, b, h]``; weight ``[v'/t, h]``.

    Raises:
        ValueError: under SP if s is not divisible by t.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ParallelGroup, *, sequence_parallel: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        self.spec = ShardSpec(dim=0, full_size=num_embeddings, padded_size=padded_size(num_embeddings, group.size))
        self.per_rank = self.spec.padded_size // group.size
        self.vocab_start = group.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim).normal_(std=0.02))
        set_shard_spec(self.weight, self.spec)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ParallelGroup, **kwargs) -> "VocabParallelEmbedding":
        """Shard a single-device ``nn.Embedding`` (rows sliced; padding rows zero)."""
        with torch.device("meta"):  # a skeleton: its weight is replaced by the slice
            layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, **kwargs)
        layer.weight = shard_parameter(embedding.weight, layer.spec, group)
        return layer

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = input_ids.t()  # [s, b]: sequence-first from here on
        if self.group.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [s, b, h]
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # partial: only this rank's tokens
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)  # [s/t, b, h]
        return reduce_from_tensor_parallel_region(out, self.group)  # [s, b, h]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.spec.padded_size}, local {self.per_rank}), {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
