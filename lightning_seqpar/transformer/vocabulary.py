"""The LM head over the vocabulary split across the tensor-parallel group: one implementation for the reference GPT
and Hugging Face causal LMs (Megatron-LM's output layer, a ``ColumnParallelLinear`` over the padded vocabulary).

The head's shard is ``[v'/t, h]``, rows cut as the :class:`~lightning_seqpar.VocabParallelEmbedding`'s are, so a tied
head is the embedding's own parameter. Its logits stay split over the vocabulary: the loss takes them as they are
(:func:`~lightning_seqpar.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`); a caller that reads them as a
tensor gets them gathered once (:class:`~lightning_seqpar.tensor_parallel.vocab_logits.VocabShardedLogits`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.embedding import VocabParallelEmbedding
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear
from lightning_seqpar.tensor_parallel.sharding import shard_parameter
from lightning_seqpar.parallel.split_sizes import padded_size
from lightning_seqpar.parallel.placement import ShardSpec, set_shard_spec
from lightning_seqpar.tensor_parallel.vocab_logits import VocabShardedLogits
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.materialize import Initializer


class VocabParallelHead(ColumnParallelLinear):
    """The LM head split over the (padded) vocabulary.

    Args:
        in_features: h. vocab_size: v (padded to a multiple of t inside).
        group: the tensor-parallel group.
        sequence_parallel: the input is the sequence shard ``[s/t, b, h]`` (all-gathered along s, g) rather than
            replicated.
        wrap_logits: return :class:`VocabShardedLogits` (single-device shape ``[..., v]``) instead of the plain shard.
        loss_chunk: with ``wrap_logits``, return the logits pending (computed when read, or by a vocabulary-parallel
            loss ``loss_chunk`` positions of dim 1 at a time: :meth:`VocabShardedLogits.over_chunks`); ``None``: at once.

    Shapes: input ``[s/t, b, h]`` (SP) or ``[..., h]`` replicated; output ``[..., v'/t]``; weight ``[v'/t, h]``.
    """

    splits_weight_gradient = False  # its W would keep the logits' gradient [s, b, v/t] per waiting micro-batch

    def __init__(self, in_features: int, vocab_size: int, group: ParallelGroup, *, sequence_parallel: bool = False,
                 wrap_logits: bool = False, bias: bool = False, loss_chunk: Optional[int] = None) -> None:
        padded = padded_size(vocab_size, group.size)
        super().__init__(in_features, padded, group, bias=bias, sequence_parallel=sequence_parallel)
        self.bias_spec = ShardSpec(0, vocab_size, padded)  # Phi's head has a bias: padded with the vocabulary
        if self.bias is not None:
            set_shard_spec(self.bias, self.bias_spec)
        self.vocab_size, self.wrap_logits, self.loss_chunk = vocab_size, wrap_logits, loss_chunk

    def forward(self, x: Tensor) -> Tensor:
        if self.wrap_logits and self.loss_chunk is not None and x.dim() == 3:  # [b, s, h]: chunks of s
            return VocabShardedLogits.pending(super().forward, x, self.group, self.vocab_size, self.loss_chunk)
        local = super().forward(x)
        return VocabShardedLogits.wrap(local, self.group, self.vocab_size) if self.wrap_logits else local


def parallel_lm_head(head: nn.Linear, embedding: VocabParallelEmbedding, ctx: RewriteContext, name: str, *,
                     tied: bool, sequence_parallel: bool = False, wrap_logits: bool = False,
                     init: Optional[Initializer] = None, loss_chunk: Optional[int] = None) -> VocabParallelHead:
    """The :class:`VocabParallelHead` of the single-device ``head`` (``[v, h]``): sharing ``embedding``'s weight when
    ``tied``, else this rank's rows of ``head.weight`` (filled later if ``head`` is on the meta device; ``name`` and
    ``init`` are the materializer's)."""

    def skeleton() -> VocabParallelHead:
        with torch.device("meta"):  # its weight is the embedding's or the head's slice
            return VocabParallelHead(head.in_features, head.out_features, ctx.group, sequence_parallel=sequence_parallel,
                                     wrap_logits=wrap_logits, bias=head.bias is not None, loss_chunk=loss_chunk)

    def with_bias(parallel: VocabParallelHead, linear: nn.Module) -> VocabParallelHead:
        if linear.bias is not None:
            parallel.bias = shard_parameter(linear.bias, parallel.bias_spec, ctx.group)
        return parallel

    if tied:
        if head.bias is not None:
            raise ValueError(f"{name}: an LM head tied to the embedding and with a bias of its own is not supported "
                             f"under tensor parallelism. Untie it (tie_word_embeddings=False), or drop the bias.")
        parallel = skeleton()
        parallel.weight = embedding.weight
        return parallel

    def sliced(linear: nn.Module) -> nn.Module:
        parallel = skeleton()
        parallel.weight = shard_parameter(linear.weight, embedding.spec, ctx.group)
        return with_bias(parallel, linear)

    return ctx.build(head, name, sliced, init)
