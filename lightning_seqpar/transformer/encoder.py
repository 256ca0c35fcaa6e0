"""torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` under tensor (+sequence) parallelism.

An encoder layer is a declaration (:data:`ENCODER_LAYER`) served by the one parallel layer,
:class:`~lightning_seqpar.transformer.declared_block.ParallelBlock`: ``norm_first`` both ways, ``batch_first`` both
ways, any elementwise activation, ``src_mask`` / ``is_causal`` / ``src_key_padding_mask``, the attention heads and
FFN features split over t ranks. Submodule and parameter names mirror torch's (``self_attn.in_proj_weight``,
``linear1``, ``norm2`` ...), so state-dict keys are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.declared_block import ParallelBlock
from lightning_seqpar.transformer.masks import torch_attention_bias
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region
from lightning_seqpar.transformer.roles import LayerStack
from lightning_seqpar.transformer.stack import run_layers

ENCODER_LAYER = BlockSpec(
    attention_norm="norm1", mlp_norm="norm2", qkv="self_attn", attention_out="self_attn.out_proj",
    mlp_in="linear1", mlp_out="linear2", activation="activation", num_heads="self_attn.num_heads",
    attention_dropout="self_attn.dropout", residual_dropouts=("dropout1", "dropout2"), mlp_dropout="dropout",
    causal=False, norm_first="norm_first", batch_first="self_attn.batch_first",
    arguments=("src_mask", "src_key_padding_mask", "is_causal"),
)
"""``nn.TransformerEncoderLayer`` as a declaration: packed ``in_proj_weight`` column-parallel by head blocks,
``out_proj`` and ``linear2`` row-parallel, ``dropout`` inside the feed-forward on ``ffn/t`` features, pre- or
post-norm as the layer's ``norm_first`` says."""


def parallel_encoder_layer(layer: nn.TransformerEncoderLayer, ctx: RewriteContext, *, enter_region: bool = True,
                           exit_region: bool = True) -> ParallelBlock:
    """The tensor (+sequence) parallel version of ``layer``; called as torch's layer is
    (``layer(src, src_mask=None, src_key_padding_mask=None, is_causal=False)``)."""
    return ParallelBlock(layer, ENCODER_LAYER, ctx, enter_region=enter_region, exit_region=exit_region)


class ParallelTransformerEncoder(LayerStack):
    """``nn.TransformerEncoder`` with TP (+SP): one region for the whole stack and its final norm; the masks are
    combined into one bias once per forward and handed to every layer.

    Shapes: ``src`` ``[b, s, h]`` (batch_first) or ``[s, b, h]``; output the same.

    Roles: :class:`~lightning_seqpar.transformer.roles.LayerStack` over ``layers``.
    """

    def __init__(self, encoder: nn.TransformerEncoder, ctx: RewriteContext) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.num_heads = encoder.layers[0].self_attn.num_heads
        self.layers = nn.ModuleList()
        for i in range(len(encoder.layers)):
            self.layers.append(ctx.build(
                encoder.layers[i], f"layers.{i}",
                lambda layer: parallel_encoder_layer(layer, ctx, enter_region=False, exit_region=False),
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
        s = x.shape[0] * (self.group.size if self.sp else 1)
        bias, causal = torch_attention_bias(mask, src_key_padding_mask, bool(is_causal), s, x.shape[1], self.num_heads,
                                            self.group, x.dtype, x.device)
        x = run_layers(self.layers, x, self.recompute_chunks, self.rng_tracker, attention_mask=bias, is_causal=causal)
        if self.norm is not None:
            x = self.norm(x)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first)
