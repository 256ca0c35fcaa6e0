"""Tensor + sequence parallel version of a Llama-layout decoder layer (Hugging Face ``LlamaDecoderLayer`` and
every model of the same shape: Mistral, Qwen2, ...).

The layout: ``x + o_proj(attention(q_proj, k_proj, v_proj of RMSNorm(x)))``, then
``x + down_proj(act(gate_proj(·)) · up_proj(·))`` of a second RMSNorm, rotary position embeddings applied
to q and k, grouped-query attention (``num_key_value_heads`` ≤ heads), optional q/k/v/o biases.

Split as Megatron splits its GPT layer (Korthikanti et al. 2022, Fig. 5): q/k/v and gate/up are
column-parallel and each group shares one g (all-gather of the ``[s/t, b, h]`` norm output, only the
shard kept for backward), o_proj and down_proj are row-parallel ending in ḡ (reduce-scatter); the
norms and residual adds run on ``[s/t, b, h]`` shards (their weights are sequence-parallel). Query and
key/value heads are split over t ranks, so both head counts must divide by t. Rotary embeddings are
applied after the gather, to the whole sequence, with the model's own ``apply_rotary_pos_emb``.

Parameter names mirror the original's (``self_attn.q_proj.weight``, ``mlp.down_proj.weight`` ...), so
state-dict keys are unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.roles import LayerDims, ParallelLayer
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.checkpointing import checkpoint
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention, merge_heads
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A Hugging Face attention mask (``[b, 1, s, s]``; bool with ``True`` = attend, or additive float) as an
    additive bias for :class:`CoreAttention`."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class ParallelLlamaAttention(nn.Module):
    """Grouped-query self-attention with query and key/value heads split over t ranks.

    Shapes: ``x`` ``[s/t, b, h]`` (SP) or ``[s, b, h]``; q ``[b, a/t, s, d]``, k/v ``[b, a_kv/t, s, d]``;
    output like ``x``.
    """

    def __init__(self, attention: nn.Module, ctx: RewriteContext, num_heads: int, num_kv_heads: int, head_dim: int,
                 implementation: str, rotary: Callable[..., tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.group, self.sp = ctx.group, ctx.sp
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.heads_local, self.kv_heads_local = num_heads // ctx.tp, num_kv_heads // ctx.tp
        self.implementation, self.rotary = implementation, rotary
        self.scaling = getattr(attention, "scaling", head_dim**-0.5)
        self.dropout = float(getattr(attention, "attention_dropout", 0.0))
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ColumnParallelLinear.from_linear(getattr(attention, name), ctx.group,
                                                                 sequence_parallel=ctx.sp))
        self.o_proj = RowParallelLinear.from_linear(attention.o_proj, ctx.group, sequence_parallel=ctx.sp)
        # float32 softmax, as transformers' eager attention computes it: the same numbers as the single-device model.
        self.core_attention = CoreAttention(self.dropout, rng_tracker=ctx.rng_tracker, sharded_heads=ctx.tp > 1,
                                            softmax_dtype=torch.float32)

    def forward(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor], mask: Optional[Tensor]) -> Tensor:
        q, k, v = column_parallel_linears(x, [self.q_proj, self.k_proj, self.v_proj], self.group, self.sp)
        s, b, _ = q.shape  # q [s, b, a/t · d], k and v [s, b, a_kv/t · d]
        q = q.view(s, b, self.heads_local, self.head_dim).permute(1, 2, 0, 3)  # [b, a/t, s, d]
        k = k.view(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)  # [b, a_kv/t, s, d]
        v = v.view(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)
        cos, sin = position_embeddings  # [b or 1, s, d]: the whole sequence's positions
        q, k = self.rotary(q, k, cos, sin)
        groups = self.heads_local // self.kv_heads_local
        if self.implementation == "sdpa":
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None,
                scale=self.scaling, enable_gqa=groups > 1,
            )
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, a/t, s, d]
            bias = additive_mask(mask, q.dtype)
            if bias is None:  # no mask given: the causal one
                bias = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
            factor = self.scaling * self.head_dim**0.5  # CoreAttention divides by √d; a model may scale otherwise
            context = self.core_attention(q * factor if factor != 1.0 else q, k, v, bias)
        return self.o_proj(merge_heads(context))  # [s/t, b, h] under SP


class ParallelGatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) · up_proj(x))`` with the intermediate features split over t ranks.

    Shapes: ``x`` ``[s/t, b, h]`` (SP) or ``[s, b, h]``; inside ``[s, b, f/t]``; output like ``x``.
    """

    def __init__(self, mlp: nn.Module, ctx: RewriteContext) -> None:
        super().__init__()
        self.group, self.sp = ctx.group, ctx.sp
        self.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, ctx.group, sequence_parallel=ctx.sp)
        self.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, ctx.group, sequence_parallel=ctx.sp)
        self.down_proj = RowParallelLinear.from_linear(mlp.down_proj, ctx.group, sequence_parallel=ctx.sp)
        self.act_fn = mlp.act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up = column_parallel_linears(x, [self.gate_proj, self.up_proj], self.group, self.sp)  # [s, b, f/t] each
        return self.down_proj(self.act_fn(gate) * up)


class ParallelLlamaDecoderLayer(ParallelLayer):
    """A Llama-layout decoder layer with TP (+SP).

    Args:
        layer: the single-device layer (``self_attn`` with q/k/v/o projections, ``mlp`` with gate/up/down,
            ``input_layernorm``, ``post_attention_layernorm``); its norms are reused, its weights sliced.
        ctx: rewrite context.
        num_heads, num_kv_heads, head_dim: from the model's config (both head counts divisible by t).
        implementation: ``"eager"`` (explicit core attention: selective recomputation applies) or ``"sdpa"``.
        rotary: the model's ``apply_rotary_pos_emb(q, k, cos, sin)``.
        enter_region / exit_region: this layer starts / ends the parallel region (batch-first ``[b, s, h]``
            outside it).

    Shapes: ``hidden_states`` ``[b, s, h]`` where a region boundary is, ``[s/t, b, h]`` (SP) or ``[s, b, h]``
    between rewritten layers; output the same. Called as Hugging Face calls its layers (keyword
    ``position_embeddings``, ``attention_mask``); caches are refused (training only).
    """

    def __init__(self, layer: nn.Module, ctx: RewriteContext, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 implementation: str, rotary: Callable[..., tuple[Tensor, Tensor]], enter_region: bool = True,
                 exit_region: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.enter_region, self.exit_region = enter_region, exit_region
        self.self_attn = ParallelLlamaAttention(layer.self_attn, ctx, num_heads, num_kv_heads, head_dim,
                                                implementation, rotary)
        self.mlp = ParallelGatedMLP(layer.mlp, ctx)
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        if ctx.sp:
            mark_sequence_parallel(self.input_layernorm)
            mark_sequence_parallel(self.post_attention_layernorm)
        hidden = layer.mlp.gate_proj.in_features
        self._dims = LayerDims(hidden, num_heads, layer.mlp.gate_proj.out_features, ctx.tp, ctx.sp)

    def layer_dims(self) -> LayerDims:
        return self._dims

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                position_embeddings: Optional[tuple[Tensor, Tensor]] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = False, **kwargs: Any) -> Tensor:
        if past_key_values is not None or use_cache:
            raise NotImplementedError("A tensor-parallel layer keeps no key/value cache: call the model with "
                                      "use_cache=False (training), or generate from the single-device model.")
        if position_embeddings is None:
            raise ValueError("The layer needs position_embeddings (cos, sin), which the model computes once.")
        x = enter_parallel_region(hidden_states, self.group, self.sp, True) if self.enter_region else hidden_states
        if self.recompute_layer and torch.is_grad_enabled():
            x = checkpoint(self._body, x, position_embeddings, attention_mask, rng_tracker=self.rng_tracker)
        else:
            x = self._body(x, position_embeddings, attention_mask)
        return exit_parallel_region(x, self.group, self.sp, True) if self.exit_region else x

    def _body(self, x: Tensor, position_embeddings: tuple[Tensor, Tensor], mask: Optional[Tensor]) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings, mask)  # [s/t, b, h]
        return x + self.mlp(self.post_attention_layernorm(x))
