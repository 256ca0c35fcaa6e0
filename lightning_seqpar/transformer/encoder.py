"""torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` under tensor (+sequence) and context parallelism.

An encoder layer is a declaration (:data:`ENCODER_LAYER`) served by the one parallel layer,
:class:`~lightning_seqpar.transformer.declared_block.ParallelBlock`: ``norm_first`` both ways, ``batch_first`` both
ways, any elementwise activation, ``src_mask`` / ``is_causal`` / ``src_key_padding_mask``, the attention heads and
FFN features split over t ranks. Submodule and parameter names mirror torch's (``self_attn.in_proj_weight``,
``linear1``, ``norm2`` ...), so state-dict keys are unchanged.

Under context parallelism (c > 1) a stack called as causal (``is_causal=True``, with or without torch's causal
``mask``, as torch documents the hint) runs its layers on this cp rank's two load-balanced chunks of the sequence
(:func:`~lightning_seqpar.context_parallel.local_indices`) in a causal layout (``src_key_padding_mask`` as its
padding), and gathers the whole sequence back where the stack ends: the model around it (the user's embedding,
head and loss) runs on the whole sequence on every cp rank, as on one device. Cost: that part's activations and
FLOPs are not divided by c (``[s, b, h]`` embedding output and the head's ``[s, b, v]`` logits on each cp rank), and
one all-gather of ``[s, b, h]`` over cp per forward (a reduce-scatter in backward, which also sums the replicated
loss's gradient c times: the data-parallel average over d·c ranks divides it back).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.context_parallel import (
    LAYOUT_ARGUMENT, ContextParallelBatch, check_context_length, local_indices,
)
from lightning_seqpar.tensor_parallel.mappings import gather_from_sequence_parallel_region

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
                           exit_region: bool = True, causal_stack: bool = False) -> ParallelBlock:
    """The tensor (+sequence) parallel version of ``layer``; called as torch's layer is
    (``layer(src, src_mask=None, src_key_padding_mask=None, is_causal=False)``). ``causal_stack``: a layer of a
    stack that runs it causally under context parallelism (:class:`ParallelTransformerEncoder` checks each call)."""
    spec = dataclasses.replace(ENCODER_LAYER, causal=True) if causal_stack else ENCODER_LAYER
    return ParallelBlock(layer, spec, ctx, enter_region=enter_region, exit_region=exit_region)


class ParallelTransformerEncoder(LayerStack):
    """``nn.TransformerEncoder`` with TP (+SP): one region for the whole stack and its final norm; the masks are
    combined into one bias once per forward and handed to every layer.

    Shapes: ``src`` ``[b, s, h]`` (batch_first) or ``[s, b, h]``; output the same (the whole sequence under context
    parallelism too: see the module docstring).

    Raises (a call under context parallelism):
        ValueError: a call that is not causal (``is_causal`` not set), naming the fix; a sequence length that does
            not split into ``2·c·t`` (:func:`~lightning_seqpar.context_parallel.check_context_length`).

    Roles: :class:`~lightning_seqpar.transformer.roles.LayerStack` over ``layers``.
    """

    def __init__(self, encoder: nn.TransformerEncoder, ctx: RewriteContext) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.context = ctx.context if ctx.cp > 1 else None
        self.num_heads = encoder.layers[0].self_attn.num_heads
        self.layers = nn.ModuleList()
        for i in range(len(encoder.layers)):
            self.layers.append(ctx.build(
                encoder.layers[i], f"layers.{i}",
                lambda layer: parallel_encoder_layer(layer, ctx, enter_region=False, exit_region=False,
                                                     causal_stack=self.context is not None),
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
        if self.context is not None:
            return self._context_parallel(src, src_key_padding_mask, bool(is_causal))
        x = enter_parallel_region(src, self.group, self.sp, self.batch_first)
        s = x.shape[0] * (self.group.size if self.sp else 1)
        bias, causal = torch_attention_bias(mask, src_key_padding_mask, bool(is_causal), s, x.shape[1], self.num_heads,
                                            self.group, x.dtype, x.device)
        x = run_layers(self.layers, x, self.recompute_chunks, self.rng_tracker, attention_mask=bias, is_causal=causal)
        if self.norm is not None:
            x = self.norm(x)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first)

    def _context_parallel(self, src: Tensor, padding: Optional[Tensor], is_causal: bool) -> Tensor:
        """The stack on this cp rank's chunks of the whole ``src``, the whole sequence gathered back (see the module
        docstring); the causal mask is the layout's, so torch's ``mask`` (the causal one, by ``is_causal``) is not
        read."""
        assert self.context is not None
        if not is_causal:
            raise ValueError(f"{type(self).__name__} under context parallelism (cp={self.context.c}) was called without "
                             f"is_causal=True: the sequence is split for causal attention. Call the encoder as torch "
                             f"documents a causal one (mask=nn.Transformer.generate_square_subsequent_mask(s), "
                             f"is_causal=True), or train without cp.")
        seq_dim = 1 if self.batch_first else 0
        s, c, rank = src.shape[seq_dim], self.context.c, self.context.group.rank
        check_context_length(s, c, self.group.size if self.sp else 1, type(self).__name__)
        mine = local_indices(s, c, rank, src.device)
        layout = ContextParallelBatch(self.context.group, self.context.comm, s, None,
                                      None if padding is None else padding.to(torch.bool))
        x = enter_parallel_region(src.index_select(seq_dim, mine), self.group, self.sp, self.batch_first)
        x = run_layers(self.layers, x, self.recompute_chunks, self.rng_tracker, attention_mask=None, is_causal=None,
                       **{LAYOUT_ARGUMENT: layout})
        if self.norm is not None:
            x = self.norm(x)
        x = exit_parallel_region(x, self.group, self.sp, batch_first=False)  # [s/c, b, h] of this cp rank
        whole = gather_from_sequence_parallel_region(x.contiguous(), self.context.group)  # reduce-scatter backward
        order = torch.cat([local_indices(s, c, r, src.device) for r in range(c)]).argsort()
        whole = whole.index_select(0, order)  # the ranks' chunks back in sequence order
        return whole.transpose(0, 1) if self.batch_first else whole
