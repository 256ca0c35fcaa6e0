"""Tensor + sequence parallel version of the reference :class:`~lightning_seqpar.models.GPT`.

Submodule names mirror the single-device model, so state-dict keys are the same. Inside, activations
are sequence-first and, under SP, sequence-sharded ``[s/t, b, h]`` from the embedding's
reduce-scatter to the LM head's all-gather (Korthikanti et al. 2022 Fig. 5, §4.3).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.context_parallel import (
    LAYOUT_ARGUMENT, ContextParallelBatch, check_context_length, local_indices,
)
from lightning_seqpar.context_parallel.loss import sum_over_context
from lightning_seqpar.models.gpt_moe import MoEMLP, TopKRouter, router_losses
from lightning_seqpar.models.sampling import Sampling
from lightning_seqpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_seqpar.tensor_parallel.embedding import VocabParallelEmbedding
from lightning_seqpar.tensor_parallel.mappings import gather_from_tensor_parallel_region
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.declared_block import ParallelBlock
from lightning_seqpar.transformer.moe_part import MoESpec
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.region import check_sequence_length
from lightning_seqpar.transformer.roles import LayerStack
from lightning_seqpar.transformer.stack import run_layers
from lightning_seqpar.transformer.vocabulary import parallel_lm_head


GPT_BLOCK = BlockSpec(
    attention_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn", attention_out="attn.c_proj", mlp_in="mlp.c_fc",
    mlp_out="mlp.c_proj", activation="mlp.gelu", num_heads="attn.n_head",
    attention_dropout="attn.core_attention.dropout", residual_dropouts=("attn.resid_dropout", "mlp.dropout"),
)
"""The reference GPT's :class:`~lightning_seqpar.models.gpt.Block` as a declaration: its parallel version is the one
declared :class:`~lightning_seqpar.transformer.declared_block.ParallelBlock` (causal core attention, fused q/k/v)."""


GPT_MOE_BLOCK = dataclasses.replace(GPT_BLOCK, mlp=MoESpec(mlp_norm="ln_2", router="mlp.gate", experts="mlp.experts",
                                                           activation="mlp.experts.act_fn"))
"""A block whose MLP is a mixture of experts (:class:`~lightning_seqpar.models.gpt.MoEMLP`): the router on each
rank's sequence-parallel tokens, the experts split over ep (:mod:`lightning_seqpar.transformer.moe_part`)."""


def parallel_gpt_block(block: nn.Module, ctx: RewriteContext) -> ParallelBlock:
    """The tensor (+sequence) parallel version of one GPT block: ``[s/t, b, h]`` (SP) or ``[s, b, h]`` in and out
    (the region is the model's, from the embedding's reduce-scatter to the LM head's all-gather)."""
    spec = GPT_MOE_BLOCK if isinstance(block.mlp, MoEMLP) else GPT_BLOCK
    return ParallelBlock(block, spec, ctx, enter_region=False, exit_region=False)


class ParallelGPT(Sampling, LayerStack):
    """The reference GPT with vocabulary-parallel embedding and LM head and TP+SP blocks.

    ``forward(idx [b, s])`` returns full logits ``[b, s, v]`` (gathered over the vocabulary; under SP
    a sequence whose length is not a multiple of t is right-padded, which causal attention makes
    exact). ``forward(idx, targets)`` returns the mean loss, computed on vocabulary-sharded logits
    (``loss_parallel``) or on gathered ones.

    Roles: :class:`~lightning_seqpar.transformer.roles.LayerStack` over ``transformer.h``; on a later pipeline stage
    it skips the embedding (the stage's first layer takes the received activation).

    Raises:
        ValueError: under SP, if a training sequence length is not divisible by t.
    """

    def __init__(self, gpt: nn.Module, ctx: RewriteContext) -> None:
        # ``gpt`` is consumed: its blocks are released as they are sliced.
        nn.Module.__init__(self)
        self.config, self.group, self.sp = gpt.config, ctx.group, ctx.sp
        self.context = ctx.context if ctx.cp > 1 else None
        self.loss_parallel = ctx.loss_parallel
        self.rng_tracker = ctx.rng_tracker
        old = gpt.transformer
        init = functools.partial(type(gpt).init_module, n_layer=gpt.config.n_layer)
        for name in ("wte", "wpe", "ln_f"):  # built on the meta device: materialized here, once
            ctx.prepare(old[name], f"transformer.{name}", init)
        wte = VocabParallelEmbedding.from_embedding(old.wte, ctx.group, sequence_parallel=ctx.sp)
        if ctx.sp:
            mark_sequence_parallel(old.wpe)  # each rank adds only its s/t rows
            mark_sequence_parallel(old.ln_f)
        blocks = nn.ModuleList()
        for i in range(len(old.h)):
            blocks.append(ctx.build(old.h[i], f"transformer.h.{i}", lambda b: parallel_gpt_block(b, ctx), init))
            old.h[i] = nn.Identity()  # the replaced model lets go of each block once it is sliced: one model in memory
        self.transformer = nn.ModuleDict(
            dict(
                wte=wte,
                wpe=old.wpe,
                drop=ParallelDropout(old.drop.p, ctx.rng_tracker, sharded=ctx.sp),
                h=blocks,
                ln_f=old.ln_f,
            )
        )
        if not gpt.config.tie_weights:
            ctx.prepare(gpt.lm_head, "lm_head", init)  # materialized with the embedding, as every stage holds both
        self.lm_head = parallel_lm_head(gpt.lm_head, wte, ctx, "lm_head", tied=gpt.config.tie_weights,
                                        sequence_parallel=ctx.sp)
        self.recompute_chunks: list[tuple[int, int]] = []

    def stack_layers(self) -> nn.ModuleList:
        return self.transformer.h

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        if self.context is not None:
            return self._context_parallel_loss(idx, targets)
        b, s = idx.shape
        t = self.group.size
        pad = 0
        if self.sp and s % t:
            if targets is not None:
                check_sequence_length(s, self.group, "ParallelGPT")
            pad = t - s % t  # inference only: trailing pad tokens cannot reach earlier positions
            idx = torch.cat([idx, idx.new_zeros(b, pad)], dim=1)
        s_total = s + pad
        if s_total > self.config.block_size:
            raise ValueError(f"Sequence length {s_total} exceeds block_size {self.config.block_size}.")
        if self.stage_position is not None and not self.stage_position.feeds_pipeline:
            x = idx.new_empty(0)  # a later pipeline stage: its first layer takes the received activation
        else:
            x = self.transformer.wte(idx)  # [s/t, b, h] (SP) or [s, b, h]
            s_local = x.shape[0]
            first = self.group.rank * s_local if self.sp else 0
            pos = torch.arange(first, first + s_local, device=idx.device)
            x = self.transformer.drop(x + self.transformer.wpe(pos).unsqueeze(1))
        x = run_layers(self.transformer.h, x, self.recompute_chunks, self.rng_tracker)
        logits = self.lm_head(self.transformer.ln_f(x))  # [s, b, v'/t], all-gather g inside
        if targets is not None and self.loss_parallel:
            return vocab_parallel_cross_entropy(
                logits, targets.t(), self.group, self.config.vocab_size,
                label_smoothing=self.config.label_smoothing, ignore_index=-1,
            ) + self._balancing()
        logits = gather_from_tensor_parallel_region(logits, self.group)[..., : self.config.vocab_size]
        logits = logits.transpose(0, 1)[:, :s]  # [b, s, v]
        if targets is None:
            return logits
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
            ignore_index=-1, label_smoothing=self.config.label_smoothing,
        ) + self._balancing()

    def _balancing(self) -> Tensor | float:
        """The mixture's load-balancing loss over every rank's tokens (:meth:`GPT.load_balancing_loss`'s value and
        gradient: 1/c of it on each cp rank, whose losses are summed); 0 without it."""
        if not self.config.output_router_logits:
            return 0.0
        return router_losses(self.config, tuple(m.last_logits for m in self.transformer.h.modules()
                                                if isinstance(m, TopKRouter)))

    def _context_parallel_loss(self, idx: Tensor, targets: Optional[Tensor]) -> Tensor:
        """Under context parallelism: this cp rank's tokens (chunks r and 2c−1−r) from the embedding to the loss, at
        their true positions; the loss is its tokens' sum over the whole batch's count of targets, summed over cp
        (:mod:`lightning_seqpar.context_parallel`).

        Raises:
            ValueError: no ``targets`` (logits of the whole sequence are not gathered over cp: generate from the
                single-device model), or a sequence length not divisible by ``2·c·t``.
        """
        if targets is None:
            raise ValueError("ParallelGPT under context parallelism computes the loss (model(idx, targets)); logits of "
                             "the whole sequence are held by no rank. Generate from the single-device model "
                             "(lightning_seqpar.checkpoint.consolidate, or the strategy's full_state_dict()).")
        b, s = idx.shape
        c, t = self.context.c, self.group.size
        check_context_length(s, c, t if self.sp else 1, "ParallelGPT")
        if s > self.config.block_size:
            raise ValueError(f"Sequence length {s} exceeds block_size {self.config.block_size}.")
        mine = local_indices(s, c, self.context.group.rank, idx.device)
        layout = ContextParallelBatch(self.context.group, self.context.comm, s)
        if self.stage_position is not None and not self.stage_position.feeds_pipeline:
            x = idx.new_empty(0)  # a later pipeline stage: its first layer takes the received activation
        else:
            x = self.transformer.wte(idx[:, mine])  # [s/(c·t), b, h] (SP) or [s/c, b, h]
            shard = x.shape[0]
            first = self.group.rank * shard if self.sp else 0
            pos = mine[first:first + shard]  # the tokens' true positions
            x = self.transformer.drop(x + self.transformer.wpe(pos).unsqueeze(1))
        x = run_layers(self.transformer.h, x, self.recompute_chunks, self.rng_tracker, **{LAYOUT_ARGUMENT: layout})
        logits = self.lm_head(self.transformer.ln_f(x))  # [s/c, b, v'/t]
        local = targets[:, mine]
        count = (targets != -1).sum().clamp(min=1)
        if self.loss_parallel:
            summed = vocab_parallel_cross_entropy(logits, local.t(), self.group, self.config.vocab_size,
                                                  label_smoothing=self.config.label_smoothing, ignore_index=-1,
                                                  reduction="sum")
        else:
            logits = gather_from_tensor_parallel_region(logits, self.group)[..., : self.config.vocab_size].float()
            summed = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), local.t().reshape(-1),
                                                 ignore_index=-1, label_smoothing=self.config.label_smoothing,
                                                 reduction="sum")
        return sum_over_context(summed / count + self._balancing(), self.context.group)
