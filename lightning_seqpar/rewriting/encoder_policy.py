"""Policies for ``torch.nn.TransformerEncoderLayer`` and ``torch.nn.TransformerEncoder``."""

from __future__ import annotations

import torch.nn as nn

from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.encoder import ParallelTransformerEncoder, parallel_encoder_layer
from lightning_seqpar.rewriting.policy import Policy, StackPolicy, require_divisible


def _check_layer(layer: nn.TransformerEncoderLayer, ctx: RewriteContext, name: str) -> None:
    mha = layer.self_attn
    if mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            f"{name}: only self-attention with kdim = vdim = embed_dim, no bias_k/bias_v and no add_zero_attn "
            f"can be split over tensor-parallel ranks."
        )
    require_divisible(name, "nhead", mha.num_heads, ctx.tp)
    require_divisible(name, "dim_feedforward", layer.linear1.out_features, ctx.tp)


class TransformerEncoderLayerPolicy(Policy):
    """``nn.TransformerEncoderLayer`` → the declared :class:`~lightning_seqpar.transformer.declared_block.ParallelBlock`
    (:data:`~lightning_seqpar.transformer.encoder.ENCODER_LAYER`)."""

    block = nn.TransformerEncoderLayer

    def check(self, module, ctx, name):
        _check_layer(module, ctx, name)

    def describe(self, module, ctx):
        h, a, ffn = module.self_attn.embed_dim, module.self_attn.num_heads, module.linear1.out_features
        return (
            f"self_attn: {a} heads → {a // ctx.tp} per rank (in_proj column-parallel, out_proj row-parallel); "
            f"linear1 {h}→{ffn} column-parallel, linear2 {ffn}→{h} row-parallel; "
            f"norm1/norm2/dropout1/dropout2 {'sequence-parallel' if ctx.sp else 'replicated'}"
        )

    def rewrite(self, module, ctx, *, enter_region, exit_region):
        return parallel_encoder_layer(module, ctx, enter_region=enter_region, exit_region=exit_region)


class TransformerEncoderPolicy(StackPolicy):
    """``nn.TransformerEncoder`` → :class:`ParallelTransformerEncoder` (one region for all its layers)."""

    block = nn.TransformerEncoder

    def check(self, module, ctx, name):
        for i, layer in enumerate(module.layers):
            if type(layer) is not nn.TransformerEncoderLayer:
                raise ValueError(f"{name}.layers.{i}: {type(layer).__name__} is not an nn.TransformerEncoderLayer.")
            _check_layer(layer, ctx, f"{name}.layers.{i}")

    def describe(self, module, ctx):
        first = TransformerEncoderLayerPolicy().describe(module.layers[0], ctx)
        return f"{len(module.layers)} layers, one parallel region; each layer: {first}"

    def rewrite(self, module, ctx, *, enter_region, exit_region):
        return ParallelTransformerEncoder(module, ctx)
