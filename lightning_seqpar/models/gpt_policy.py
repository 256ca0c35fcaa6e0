"""Policy for the reference :class:`~lightning_seqpar.models.GPT`, declared by the model itself
(:meth:`GPT.parallel_policy`), as a user's model would declare its own."""

from __future__ import annotations

import torch.nn as nn

from lightning_seqpar.models.parallel_gpt import GPT_MOE_BLOCK, ParallelGPT
from lightning_seqpar.rewriting.policy import StackPolicy, require_divisible
from lightning_seqpar.transformer.region import check_sequence_length


class GPTPolicy(StackPolicy):
    """:class:`~lightning_seqpar.models.GPT` → :class:`ParallelGPT`: vocabulary-parallel embedding (entering the SP region by
    reduce-scatter), TP+SP blocks, sequence-parallel final norm, column-parallel LM head."""

    def __init__(self, block: type[nn.Module]) -> None:
        self.block = block  # type: ignore[misc]  # the GPT class itself, which names this policy

    def check(self, module, ctx, name):
        c = module.config
        require_divisible(name, "n_head", c.n_head, ctx.tp)
        require_divisible(name, "ffn_hidden_size", c.ffn_hidden_size or 4 * c.n_embd, ctx.tp)
        if c.n_experts:  # the mixture's own refusals: experts that ep does not divide, tp without SP
            GPT_MOE_BLOCK.mlp.check_split(module.transformer.h[0], ctx, name)
        if ctx.sp:
            check_sequence_length(c.block_size, ctx.group, f"{name} (block_size)")

    def describe(self, module, ctx):
        c = module.config
        v_padded = -(-c.vocab_size // ctx.tp) * ctx.tp
        region = "sequence-parallel [s/t, b, h]" if ctx.sp else "replicated [s, b, h]"
        experts = (f"; MLPs: {GPT_MOE_BLOCK.mlp.describe(module.transformer.h[0], ctx)}" if c.n_experts else "")
        return (
            f"wte: vocab {c.vocab_size} (padded {v_padded}) → {v_padded // ctx.tp} rows per rank; "
            f"{c.n_layer} blocks with {c.n_head // ctx.tp} heads per rank, activations {region}; "
            f"lm_head column-parallel{' (tied)' if c.tie_weights else ''}; "
            f"loss {'vocab-parallel' if ctx.loss_parallel else 'on gathered logits'}" + experts
        )

    def rewrite(self, module, ctx, *, enter_region, exit_region):
        return ParallelGPT(module, ctx)
