"""Tensor + sequence parallel versions of ``torch.nn.TransformerEncoderLayer`` / ``TransformerEncoder``.

They compute what torch's modules compute (``norm_first`` both ways, ``batch_first`` both ways, any
elementwise activation, ``src_mask`` / ``is_causal`` / ``src_key_padding_mask``) with the attention
heads and FFN features split over t ranks. Submodule and parameter names mirror torch's
(``self_attn.in_proj_weight``, ``linear1``, ``norm2`` ...), so state-dict keys are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linear
from lightning_seqpar.tensor_parallel.sharding import ShardSpec, mark_sequence_parallel, shard_parameter
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention, merge_heads, split_heads
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region
from lightning_seqpar.transformer.roles import LayerDims, LayerStack, ParallelLayer
from lightning_seqpar.transformer.stack import run_layers


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def attention_bias(
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    s: int,
    b: int,
    num_heads: int,
    group: ParallelGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> Optional[Tensor]:
    """Combine torch-style masks into one additive bias for this rank's heads.

    Args:
        attn_mask: ``[s, s]`` or ``[b·a, s, s]`` (global heads), bool (``True`` = masked) or float.
        key_padding_mask: ``[b, s]``, bool (``True`` = padding) or float.
        is_causal: mask future positions when ``attn_mask`` is not given.

    Returns:
        ``None`` or a tensor broadcastable to ``[b, a/t, s, s]``.
    """
    bias = None
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    if attn_mask is not None:
        bias = _additive(attn_mask, dtype)
        if bias.dim() == 2:
            bias = bias.view(1, 1, s, s)
        else:  # per-head masks: keep this rank's heads
            local = num_heads // group.size
            bias = bias.view(b, num_heads, s, s)[:, group.rank * local : (group.rank + 1) * local]
    if key_padding_mask is not None:
        padding = _additive(key_padding_mask, dtype).view(b, 1, 1, s)
        bias = padding if bias is None else bias + padding
    return bias


class ParallelMultiheadAttention(nn.Module):
    """Self-attention of an ``nn.MultiheadAttention`` with heads split over t ranks.

    ``in_proj_weight`` ``[3h/t, h]`` holds this rank's q, k and v rows; ``out_proj`` is row-parallel.

    Shapes: ``x`` ``[s/t, b, h]`` (SP) or ``[s, b, h]``; output the same.
    """

    def __init__(self, mha: nn.MultiheadAttention, ctx: RewriteContext) -> None:
        super().__init__()
        self.group, self.sp = ctx.group, ctx.sp
        self.num_heads = mha.num_heads
        self.num_heads_local = mha.num_heads // ctx.tp
        spec = ShardSpec(dim=0, full_size=3 * mha.embed_dim, padded_size=3 * mha.embed_dim, chunks=3)
        self.in_proj_weight = shard_parameter(mha.in_proj_weight, spec, ctx.group)
        self.in_proj_bias = shard_parameter(mha.in_proj_bias, spec, ctx.group) if mha.in_proj_bias is not None else None
        self.core_attention = CoreAttention(mha.dropout, rng_tracker=ctx.rng_tracker, sharded_heads=ctx.tp > 1)
        self.out_proj = RowParallelLinear.from_linear(mha.out_proj, ctx.group, sequence_parallel=ctx.sp)

    def forward(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        qkv = column_parallel_linear(x, self.in_proj_weight, self.in_proj_bias, self.group, self.sp)  # [s, b, 3h/t]
        q, k, v = split_heads(qkv, self.num_heads_local)  # [b, a/t, s, d]
        return self.out_proj(merge_heads(self.core_attention(q, k, v, bias)))


class ParallelTransformerEncoderLayer(ParallelLayer):
    """``nn.TransformerEncoderLayer`` with TP (+SP).

    Args:
        layer: the single-device layer; its weights are sliced, its norms and activation reused.
        ctx: rewrite context.
        enter_region: this layer starts the parallel region (transposes a batch-first input and,
            under SP, scatters it along s).
        exit_region: this layer ends it (gathers along s, transposes back).

    Shapes: input and output as torch's layer where a region boundary is, else ``[s/t, b, h]`` (SP)
    or ``[s, b, h]`` between rewritten layers.

    Roles: :class:`~lightning_seqpar.transformer.roles.ParallelLayer` (full recomputation honours ``recompute_layer``).
    """

    def __init__(self, layer: nn.TransformerEncoderLayer, ctx: RewriteContext, *, enter_region: bool = True,
                 exit_region: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.batch_first, self.norm_first = layer.self_attn.batch_first, layer.norm_first
        self.enter_region, self.exit_region = enter_region, exit_region
        self.self_attn = ParallelMultiheadAttention(layer.self_attn, ctx)
        self.linear1 = ColumnParallelLinear.from_linear(layer.linear1, ctx.group, sequence_parallel=ctx.sp)
        self.dropout = ParallelDropout(layer.dropout.p, ctx.rng_tracker, sharded=ctx.tp > 1)  # on ffn/t features
        self.linear2 = RowParallelLinear.from_linear(layer.linear2, ctx.group, sequence_parallel=ctx.sp)
        self.norm1, self.norm2 = layer.norm1, layer.norm2
        if ctx.sp:
            mark_sequence_parallel(self.norm1)
            mark_sequence_parallel(self.norm2)
        self.dropout1 = ParallelDropout(layer.dropout1.p, ctx.rng_tracker, sharded=ctx.sp)
        self.dropout2 = ParallelDropout(layer.dropout2.p, ctx.rng_tracker, sharded=ctx.sp)
        self.activation = layer.activation
        self._dims = LayerDims(layer.linear1.in_features, layer.self_attn.num_heads, layer.linear1.out_features,
                               ctx.tp, ctx.sp)

    def layer_dims(self) -> LayerDims:
        return self._dims

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        x = enter_parallel_region(src, self.group, self.sp, self.batch_first) if self.enter_region else src
        s = x.shape[0] * (self.group.size if self.sp else 1)
        bias = attention_bias(src_mask, src_key_padding_mask, is_causal, s, x.shape[1], self.self_attn.num_heads,
                              self.group, x.dtype, x.device)
        if self.recompute_layer and torch.is_grad_enabled():
            x = recomputed(self._body, x, bias, rng_tracker=self.rng_tracker)
        else:
            x = self._body(x, bias)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first) if self.exit_region else x

    def _body(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x), bias))
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self.dropout1(self.self_attn(x, bias)))
        return self.norm2(x + self._ff(x))

    def _ff(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))  # [s, b, ffn/t] inside


class ParallelTransformerEncoder(LayerStack):
    """``nn.TransformerEncoder`` with TP (+SP): one region for the whole stack and its final norm.

    Shapes: ``src`` ``[b, s, h]`` (batch_first) or ``[s, b, h]``; output the same.

    Roles: :class:`~lightning_seqpar.transformer.roles.LayerStack` over ``layers``.
    """

    def __init__(self, encoder: nn.TransformerEncoder, ctx: RewriteContext) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.layers = nn.ModuleList()
        for i in range(len(encoder.layers)):
            self.layers.append(ctx.build(
                encoder.layers[i], f"layers.{i}",
                lambda layer: ParallelTransformerEncoderLayer(layer, ctx, enter_region=False, exit_region=False),
            ))
            encoder.layers[i] = nn.Identity()  # released once sliced: one model in memory, not 1 + 1/t
        if encoder.norm is not None:
            ctx.prepare(encoder.norm, "norm")
        self.norm = encoder.norm
        if self.norm is not None and ctx.sp:
            mark_sequence_parallel(self.norm)
        self.batch_first = self.layers[0].batch_first
        self.recompute_chunks: list[tuple[int, int]] = []

    def stack_layers(self) -> nn.ModuleList:
        return self.layers

    def forward(self, src: Tensor, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                is_causal: Optional[bool] = None) -> Tensor:
        x = enter_parallel_region(src, self.group, self.sp, self.batch_first)
        x = run_layers(self.layers, x, self.recompute_chunks, self.rng_tracker, src_mask=mask,
                       src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
        if self.norm is not None:
            x = self.norm(x)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first)
