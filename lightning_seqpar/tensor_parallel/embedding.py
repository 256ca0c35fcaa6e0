"""Vocabulary-parallel embedding (Megatron-LM ``VocabParallelEmbedding``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import (
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from lightning_seqpar.tensor_parallel.sharding import init_shard, shard_parameter
from lightning_seqpar.parallel.split_sizes import padded_size
from lightning_seqpar.parallel.placement import ShardSpec


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
        batch_first: without SP, return ``[b, s, h]`` (a Hugging Face model's layout outside its layers).
        padding_idx: the token whose row gets no gradient (``nn.Embedding``'s ``padding_idx``), held by one rank.
        scale: a factor the embedding is multiplied by (Gemma's ``√h``), applied as the single-device model does:
            rounded to the weight's dtype first; ``None``: none.

    Shapes: input ids ``[b, s]`` (batch-first, as a data loader gives them); output sequence-first
    ``[s/t, b, h]`` under SP, else ``[s, b, h]`` (or ``[b, s, h]`` with ``batch_first``); weight ``[v'/t, h]``.

    Raises:
        ValueError: under SP if s is not divisible by t.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ParallelGroup, *, sequence_parallel: bool = False,
                 batch_first: bool = False, padding_idx: Optional[int] = None, scale: Optional[float] = None):
        super().__init__()
        if sequence_parallel and batch_first:
            raise ValueError("VocabParallelEmbedding: the sequence-parallel output is sequence-first; batch_first=True "
                             "needs sequence_parallel=False.")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel, self.batch_first = group, sequence_parallel, batch_first
        self.padding_idx, self.scale = padding_idx, scale
        self.spec = ShardSpec(dim=0, full_size=num_embeddings, padded_size=padded_size(num_embeddings, group.size))
        self.per_rank = self.spec.padded_size // group.size
        self.vocab_start = group.rank * self.per_rank
        self.weight = init_shard((num_embeddings, embedding_dim), self.spec, group)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ParallelGroup, **kwargs) -> "VocabParallelEmbedding":
        """Shard a single-device ``nn.Embedding`` (rows sliced; padding rows zero; its ``padding_idx`` kept, and the
        scale of a scaled embedding: :func:`embedding_scale`)."""
        kwargs.setdefault("padding_idx", embedding.padding_idx)
        kwargs.setdefault("scale", embedding_scale(embedding))
        with torch.device("meta"):  # a skeleton: its weight is replaced by the slice
            layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, **kwargs)
        layer.weight = shard_parameter(embedding.weight, layer.spec, group)
        return layer

    def forward(self, input_ids: Tensor) -> Tensor:
        ids = input_ids if self.batch_first else input_ids.t()  # [s, b]: sequence-first from here on
        padding = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.per_rank:
            padding = self.padding_idx - self.vocab_start  # this rank holds the row that gets no gradient
        if self.group.size == 1:
            out = F.embedding(ids, self.weight, padding_idx=padding)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=padding)  # [s, b, h]
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # partial: only this rank's tokens
        if self.scale is not None:  # one nonzero partial per token: scaling before the sum is exact
            out = out * torch.tensor(self.scale, dtype=torch.float64).to(out.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)  # [s/t, b, h]
        return reduce_from_tensor_parallel_region(out, self.group)  # [s, b, h], or [b, s, h] batch-first


def embedding_scale(embedding: nn.Embedding) -> Optional[float]:
    """The factor a scaled embedding multiplies its rows by: Hugging Face's ``*ScaledWordEmbedding`` (Gemma, √h)
    keeps it as the ``embed_scale`` buffer (float32) and in ``scalar_embed_scale``; ``None`` for ``nn.Embedding``.

    Raises:
        ValueError: another subclass of ``nn.Embedding`` with its own ``forward``: what it computes is unknown.
    """
    if type(embedding).forward is nn.Embedding.forward:
        return None
    buffer = getattr(embedding, "embed_scale", None)
    if isinstance(buffer, Tensor) and buffer.numel() == 1 and not buffer.is_meta:
        return float(buffer.double())  # the stored (float32-rounded) value the model multiplies by
    scalar = getattr(embedding, "scalar_embed_scale", None)
    if isinstance(scalar, (int, float)):  # on the meta device: the buffer would be float32(scalar)
        return float(torch.tensor(float(scalar), dtype=torch.float32))
    raise ValueError(
        f"The embedding {type(embedding).__name__} overrides nn.Embedding.forward and is not a scaled embedding "
        f"(embed_scale): its vocabulary-parallel version cannot know what it computes. Supported: nn.Embedding and "
        f"Hugging Face's scaled word embeddings."
    )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.spec.padded_size}, local {self.per_rank}), {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
