"""Core attention: the part of a transformer layer that selective recomputation recomputes."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.random import RNGTracker, maybe_fork, recomputed
from lightning_seqpar.transformer.dropout import dropout
from lightning_seqpar.transformer.masks import FutureMask, apply_mask
from lightning_seqpar.transformer.upcast import keeping_16_bit_input


class CoreAttention(nn.Module):
    """``softmax(Q Kᵀ / √d + mask)`` → dropout → ``· V``, written out op by op.

    These four ops hold the ``5as²b`` bytes of Eq. 1 (softmax output, dropout mask, dropout output)
    while costing few FLOPs, so they are the ones worth recomputing (Korthikanti et al. 2022 §5,
    Fig. 3; Megatron-LM ``CoreAttention``). The explicit form keeps those tensors measurable; a
    fused kernel would not store them at all.

    Args:
        dropout: attention-probability dropout p.
        causal: mask future positions when no ``attn_mask`` is given (a given mask is the whole mask, as Hugging
            Face's causal masks are).
        rng_tracker: tracker whose tensor-parallel stream is used when ``sharded_heads``.
        sharded_heads: heads are split over tensor-parallel ranks (each rank needs its own masks).
        softmax_dtype: compute the softmax in this dtype and cast back (Hugging Face's eager attention uses
            float32 whatever the input's dtype); default: the scores' dtype.
        softcap: soft-cap the scores, ``cap · tanh(scores / cap)``, before the mask (Gemma 2); ``None``: not.

    Attributes:
        recompute: when ``True`` (set by :class:`~lightning_seqpar.SelectiveRecompute`), the forward is
            checkpointed: only q, k, v are kept for backward.

    Shapes: q, k, v ``[b, a_local, s, d]``; ``attn_mask`` broadcastable to ``[b, a_local, s, s]``, bool (``True`` =
    attend) or additive float (:func:`~lightning_seqpar.transformer.masks.apply_mask`); ``sinks`` ``[a_local]``;
    output ``[b, a_local, s, d]``.

    Attention sinks (gpt-oss; Xiao et al., *Efficient Streaming Language Models with Attention Sinks*, 2023): a
    learned logit per head joins each row's softmax as one more column, taking its share of the probability mass,
    and is dropped before ``· V`` (transformers' gpt-oss ``eager_attention_forward``).
    """

    def __init__(
        self,
        dropout: float = 0.0,
        causal: bool = False,
        rng_tracker: Optional[RNGTracker] = None,
        sharded_heads: bool = False,
        softmax_dtype: Optional[torch.dtype] = None,
        softcap: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.dropout, self.causal, self.softmax_dtype, self.softcap = dropout, causal, softmax_dtype, softcap
        self.rng_tracker, self.sharded_heads = rng_tracker, sharded_heads
        self.recompute = False
        self.future_mask = FutureMask()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                causal: Optional[bool] = None, sinks: Optional[Tensor] = None) -> Tensor:
        """``causal``: mask future positions (the cached mask) on top of ``attn_mask``; default: :attr:`causal` when
        no ``attn_mask`` is given. ``sinks``: this rank's heads' sink logits, or ``None``."""
        if causal is None:
            causal = self.causal and attn_mask is None
        if self.recompute and torch.is_grad_enabled():
            return recomputed(self._attend, q, k, v, attn_mask, causal, sinks, rng_tracker=self.rng_tracker)
        return self._attend(q, k, v, attn_mask, causal, sinks)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool,
                sinks: Optional[Tensor] = None) -> Tensor:
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [b, a, s, s]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if attn_mask is not None:
            scores = apply_mask(scores, attn_mask)
        if causal:
            scores = scores.masked_fill(self.future_mask(s, q.device), float("-inf"))
        if sinks is not None:  # one more column per row: the head's sink logit
            b, a, rows = scores.shape[:3]
            scores = torch.cat([scores, sinks.to(scores.dtype).view(1, a, 1, 1).expand(b, a, rows, 1)], dim=-1)
        # Under CUDA autocast a 16-bit softmax runs in float32 and would keep its float32 output: keep the scores
        # instead. Not when the whole core attention is recomputed: its tensors live only during its backward.
        if self.softmax_dtype is None and not self.recompute:
            probs = keeping_16_bit_input(self._softmax, scores)
        else:
            probs = self._softmax(scores)
        if sinks is not None:
            probs = probs[..., :-1]
        if self.training and self.dropout > 0:
            with maybe_fork(self.rng_tracker, self.sharded_heads):
                probs = dropout(probs, self.dropout)
        return torch.matmul(probs, v)  # [b, a, s, d]

    def _softmax(self, scores: Tensor) -> Tensor:
        floor = None if self.softmax_dtype is None else torch.finfo(self.softmax_dtype).min
        if floor is not None and floor > torch.finfo(scores.dtype).min:
            # float64 scores, float32 softmax: a masked score would cast to -inf, a fully masked row to NaN (a left
            # pad's own row); clamped, that row is uniform, as in float32
            scores = scores.clamp(min=floor)
        return F.softmax(scores, dim=-1, dtype=self.softmax_dtype).to(scores.dtype)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, causal={self.causal}, recompute={self.recompute}"


def split_heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fused projection ``[s, b, 3·a·d]`` laid out ``[q | k | v]`` → q, k, v each ``[b, a, s, d]``."""
    s, b, _ = qkv.shape
    # -1 is the head dim d: the same code serves the local a/t heads of a shard.
    q, k, v = qkv.view(s, b, 3, num_heads, -1).permute(2, 1, 3, 0, 4).unbind(0)
    return q, k, v


def merge_heads(context: Tensor) -> Tensor:
    """``[b, a, s, d]`` → ``[s, b, a·d]``."""
    b, a, s, d = context.shape
    return context.permute(2, 0, 1, 3).reshape(s, b, a * d)
