"""A pre-norm transformer block built from a declaration (:class:`BlockSpec`): which submodule is what.

Most decoder blocks are ``x + attention_out(attention(qkv(norm1(x))))`` then
``x + mlp_out(act(mlp_in(norm2(x))))`` (or a gated ``act(gate(·)) · up(·)``), with dropouts on the residual
branches and, in some families, rotary position embeddings on q and k. A :class:`BlockSpec` names the
submodules of a user's block that play each part; :class:`ParallelBlock` is the tensor (+sequence) parallel
block built from it, split as Megatron splits its GPT layer (Korthikanti et al. 2022, Fig. 5):

- the projections of the attention input (fused ``qkv``, or separate ``q``/``k``/``v``) and of the MLP input
  (``mlp_in``, or ``gate``/``up``) are column-parallel and share one g (all-gather of the ``[s/t, b, h]``
  norm output; only the shard is kept for backward: :func:`column_parallel_linears`);
- ``attention_out`` and ``mlp_out`` are row-parallel and end in ḡ (reduce-scatter);
- the norms, residual dropouts and residual adds run on ``[s/t, b, h]`` shards (their weights are tagged
  sequence-parallel); query and key/value heads are split over t ranks (grouped-query attention included).

The user's block is not called: its parameters are sliced into the parallel block, whose parameter names
mirror the user's (``attn.c_attn.weight`` stays ``attn.c_attn.weight``), so state-dict keys are unchanged.
The block is called as the user's model calls it: ``block(hidden_states, ...)`` with ``[b, s, h]`` batch-first
where the parallel region starts or ends, and keyword ``attention_mask`` / ``position_embeddings`` as Hugging
Face passes them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.context_parallel import ContextParallelBatch, check_all_to_all_heads, context_parallel_attention
from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.layers import (
    ColumnParallelInProjection, ColumnParallelLinear, RowParallelLinear, column_parallel_linears,
)
from lightning_seqpar.tensor_parallel.norms import LocalHeadsNorm, TensorParallelRMSNorm, per_head_weights
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.block_arguments import parse_block_arguments
from lightning_seqpar.transformer.block_spec import BlockSpec, out_features, resolve, rotary_function, value_of
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention, merge_heads
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.lora import column_with_lora, row_with_lora
from lightning_seqpar.transformer.tuner_layers import linear_of
from lightning_seqpar.transformer.masks import torch_attention_bias
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region
from lightning_seqpar.transformer.roles import LayerDims, ParallelLayer

def _activation(block: nn.Module, spec: BlockSpec) -> Callable[[Tensor], Tensor]:
    if spec.activation.startswith("F."):
        return getattr(F, spec.activation[2:])
    return resolve(block, spec.activation)


def _set(root: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent, _, name = path.rpartition(".")
    target = root
    for part in filter(None, parent.split(".")):
        if not hasattr(target, part):
            target.add_module(part, nn.Module())
        target = getattr(target, part)
    target.add_module(name, module)
    return module


def _dropout_p(value: Any) -> float:
    return value.p if isinstance(value, nn.Dropout) else float(value or 0.0)


class _Parts(NamedTuple):
    attention_in: tuple[nn.Module, ...]
    mlp_in: tuple[nn.Module, ...]
    attention_out: nn.Module
    mlp_out: nn.Module
    attention_norm: nn.Module
    mlp_norm: nn.Module
    q_norm: Optional[Callable[[Tensor], Tensor]]
    k_norm: Optional[Callable[[Tensor], Tensor]]
    attention_post_norm: Optional[nn.Module]
    mlp_post_norm: Optional[nn.Module]


class ParallelBlock(ParallelLayer):
    """The tensor (+sequence) parallel version of a block described by a :class:`BlockSpec`: the one parallel
    transformer layer, serving Hugging Face decoder layers, the reference GPT's blocks, torch's
    ``nn.TransformerEncoderLayer`` and users' declared blocks.

    Args:
        block: the single-device block; its norms (and activation module) are reused, its weights sliced.
        spec: the declaration.
        ctx: rewrite context.
        enter_region / exit_region: this block starts / ends the parallel region (``[b, s, h]`` batch-first, or
            ``[s, b, h]`` when ``spec.batch_first`` is false, outside it).

    Shapes: ``hidden_states`` ``[b, s, h]`` at a region boundary, ``[s/t, b, h]`` (SP) or ``[s, b, h]``
    between rewritten blocks; q ``[b, a/t, s, d]``, k/v ``[b, a_kv/t, s, d]``; output like the input.

    Masks (:mod:`~lightning_seqpar.transformer.masks`): ``attention_mask`` in Hugging Face's convention (bool
    ``True`` = attend, or additive; ``[b, 1, s, s]`` or ``[b, a/t, s, s]``) is applied as given; torch's
    ``src_mask``/``src_key_padding_mask`` are combined into one bias and ``is_causal`` masks future positions
    (the core attention's cached ``[s, s]`` mask, built once per length); with no mask, future positions are masked
    when ``spec.causal``.

    A key/value cache is neither filled nor read (see :func:`refuse_used_cache`): a forward with the config's
    default ``use_cache`` trains and validates as on one device; a cache holding past tokens is refused.

    Arguments are taken as :mod:`~lightning_seqpar.transformer.block_arguments` says: positional ones named by
    ``spec.arguments``, the cache under either name, those without effect listed; anything else is refused.

    Raises:
        NotImplementedError: called with a key/value cache that holds past tokens, or again with a cache it has
            already seen (generation).
        TypeError: an argument the block does not understand, by name, before any communication.
    """

    def __init__(self, block: nn.Module, spec: BlockSpec, ctx: RewriteContext, *, enter_region: bool = True,
                 exit_region: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.enter_region, self.exit_region = enter_region, exit_region
        self.mask_cache = ctx.masks
        self.spec = spec
        self.returns_tuple = spec.returns_attention_weights
        self._name = f"The tensor-parallel {type(block).__name__}"
        self.batch_first = bool(value_of(block, spec.batch_first))
        self.norm_first = bool(value_of(block, spec.norm_first))
        attention, mlp = spec.projections()
        self.num_heads = value_of(block, spec.num_heads)
        self.num_kv_heads = value_of(block, spec.num_kv_heads) or self.num_heads
        hidden = out_features(resolve(block, spec.attention_out))
        self.head_dim = value_of(block, spec.head_dim) or hidden // self.num_heads
        self.heads_local, self.kv_heads_local = self.num_heads // ctx.tp, self.num_kv_heads // ctx.tp
        scaling = value_of(block, spec.scaling)
        self.score_factor = 1.0 if scaling is None else float(scaling) * self.head_dim**0.5  # CoreAttention uses 1/√d
        # Fused [q; k; v]: each of the three split over tp (per head: whole heads are contiguous rows).
        qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        chunks = qkv_sizes if spec.qkv and not spec.qkv_per_head else 1
        column = ColumnParallelLinear.from_conv1d if spec.transposed else ColumnParallelLinear.from_linear
        row = RowParallelLinear.from_conv1d if spec.transposed else RowParallelLinear.from_linear

        def column_of(path: str, chunks: Any) -> nn.Module:
            found = resolve(block, path)
            if isinstance(found, nn.MultiheadAttention):
                return ColumnParallelInProjection(found, ctx.group)
            base = column(linear_of(found), ctx.group, sequence_parallel=ctx.sp, chunks=chunks)
            return column_with_lora(base, found, ctx, f"{self._name} {path}")

        def row_of(path: str) -> nn.Module:
            found = resolve(block, path)
            base = row(linear_of(found), ctx.group, sequence_parallel=ctx.sp)
            return row_with_lora(base, found, ctx, f"{self._name} {path}")

        attention_in = tuple(_set(self, p, column_of(p, chunks)) for p in attention)
        mlp_in = tuple(_set(self, p, column_of(p, 2 if spec.gate_up else 1)) for p in mlp)
        attention_out, mlp_out = (_set(self, p, row_of(p)) for p in (spec.attention_out, spec.mlp_out))
        norms = []  # before each branch, and (post-norms) on the branch outputs: all on [s/t, b, h] under SP
        for path in (spec.attention_norm, spec.mlp_norm, spec.attention_post_norm, spec.mlp_post_norm):
            norm = resolve(block, path) if path else None
            if norm is not None:
                if ctx.sp:
                    mark_sequence_parallel(norm)
                _set(self, path, norm)
            norms.append(norm)
        head_norms: list[Any] = []
        for path, heads, local in ((spec.q_norm, self.num_heads, self.heads_local),
                                   (spec.k_norm, self.num_kv_heads, self.kv_heads_local)):
            norm = resolve(block, path) if path else None
            if norm is not None and spec.qk_norm_over_heads:  # over all heads: features split over tp
                norm = _set(self, path, TensorParallelRMSNorm(norm, ctx.group))
            elif norm is not None:  # per-head norms: each rank normalizes a/t heads
                for module in norm.modules():  # replicated; the gradient of a share of the heads: summed over tp
                    mark_sequence_parallel(module)
                _set(self, path, norm)
                if per_head_weights(norm, heads):  # a weight of its own per head: this rank's heads' weights
                    norm = LocalHeadsNorm(norm, ctx.group.rank * local, local)
            head_norms.append(norm)
        # Resolved once: the forward holds the modules, not their paths. A plain tuple, so they are registered only
        # under the block's own names (state-dict keys stay the single-device block's).
        self._parts = _Parts(attention_in, mlp_in, attention_out, mlp_out, norms[0], norms[1], *head_norms, *norms[2:])
        self.activation = _activation(block, spec)
        dropout = _dropout_p(value_of(block, spec.attention_dropout))
        self.implementation = value_of(block, spec.attention) if "." in spec.attention else spec.attention
        self.dropout_p = dropout
        self.fused_attention = self.implementation == "sdpa"
        # Only the explicit path has a CoreAttention for selective recomputation to checkpoint.
        softcap = value_of(block, spec.attention_softcap)
        self.core_attention = None if self.fused_attention else CoreAttention(
            dropout, causal=spec.causal, rng_tracker=ctx.rng_tracker, sharded_heads=ctx.tp > 1,
            softmax_dtype=spec.softmax_dtype, softcap=None if softcap is None else float(softcap))
        drops = [resolve(block, p).p for p in spec.residual_dropouts] or [0.0, 0.0]
        self.attention_residual_dropout = ParallelDropout(drops[0], ctx.rng_tracker, sharded=ctx.sp)
        self.mlp_residual_dropout = ParallelDropout(drops[1], ctx.rng_tracker, sharded=ctx.sp)
        self.mlp_inner_dropout = None if not spec.mlp_dropout else ParallelDropout(
            resolve(block, spec.mlp_dropout).p, ctx.rng_tracker, sharded=ctx.tp > 1)  # on ffn/t features
        self.rotary = rotary_function(block, spec)
        self.softcap = None if softcap is None else float(softcap)
        self.window = value_of(block, spec.sliding_window)
        self.context = ctx.context
        if ctx.cp > 1:
            self._check_context_parallel(ctx)
        multiplier = value_of(block, spec.residual_multiplier)
        self.residual_multiplier = None if multiplier is None or float(multiplier) == 1.0 else float(multiplier)
        ffn = out_features(resolve(block, mlp[0])) // (2 if spec.gate_up else 1)
        gated = len(mlp) == 2 or bool(spec.gate_up)
        self._dims = LayerDims(hidden, self.num_heads, ffn, ctx.tp, ctx.sp, self.num_kv_heads, gated)

    def _check_context_parallel(self, ctx: RewriteContext) -> None:
        """What context-parallel attention computes exactly, or a refusal naming the part and the fix.

        Raises:
            ValueError: attention-probability dropout (its masks would be drawn per ring block), a block that is not
                causal, or all-to-all attention with local head counts that do not divide by c.
        """
        if self.dropout_p > 0:
            raise ValueError(f"{self._name}: attention dropout p={self.dropout_p} under context parallelism (cp="
                             f"{ctx.cp}) is not supported: the ring computes attention block by block. Set the model's "
                             f"attention dropout to 0 (attention_dropout / attn_pdrop), as modern recipes do.")
        if not self.spec.causal:
            raise ValueError(f"{self._name}: context parallelism here balances causal attention; this block is "
                             f"declared non-causal (BlockSpec.causal=False). Train it without cp.")
        if self.context.comm == "all_to_all":
            check_all_to_all_heads(self.heads_local, self.kv_heads_local, ctx.cp, self._name)

    def layer_dims(self) -> LayerDims:
        return self._dims

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        call = parse_block_arguments(self._name, self.spec.arguments, args, kwargs)
        refuse_used_cache(self, call.cache)
        x = enter_parallel_region(hidden_states, self.group, self.sp, self.batch_first) if self.enter_region \
            else hidden_states
        layout = self.context.layout(self._name) if self.context is not None else None
        if layout is not None:  # the model's masks are of its local tokens: the layout says what each sees
            if self.dropout_p > 0 and self.training:  # one cp rank, packed documents (cp > 1 refused it at the rewrite)
                raise ValueError(f"{self._name}: attention dropout p={self.dropout_p} with packed documents "
                                 f"(position_ids) is not supported: set the model's attention dropout to 0.")
            mask, causal = layout.with_window(self.window), None
        else:
            mask, causal = self._mask(call, x)
        if self.recompute_layer and torch.is_grad_enabled():
            x = recomputed(self._body, x, call.position_embeddings, mask, causal, rng_tracker=self.rng_tracker)
        else:
            x = self._body(x, call.position_embeddings, mask, causal)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first) if self.exit_region else x

    def _mask(self, call: Any, x: Tensor) -> tuple[Optional[Tensor], Optional[bool]]:
        """The mask in Hugging Face's convention and the causal flag (``None``: causal when no mask is given and the
        block is declared causal). torch's ``src_mask``/``src_key_padding_mask`` are combined here (a standalone
        layer's call); an encoder stack passes its combined bias as ``attention_mask`` with ``is_causal``."""
        masks = call.torch_masks
        if "src_mask" not in masks and "src_key_padding_mask" not in masks:
            return call.attention_mask, (bool(masks["is_causal"]) if "is_causal" in masks else None)
        if call.attention_mask is not None:
            raise TypeError(f"{self._name} was called with both attention_mask and torch's src_mask / "
                            f"src_key_padding_mask: pass the mask in one convention.")
        s = x.shape[0] * (self.group.size if self.sp else 1)
        src_mask, padding = masks.get("src_mask"), masks.get("src_key_padding_mask")
        is_causal = bool(masks.get("is_causal"))
        return self.mask_cache.get((src_mask, padding), (is_causal, s, x.shape[1], x.dtype, x.device), lambda: (
            torch_attention_bias(src_mask, padding, is_causal, s, x.shape[1], self.num_heads, self.group, x.dtype,
                                 x.device)))

    def _body(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor],
              causal: Optional[bool] = None) -> Tensor:
        parts = self._parts
        if not self.norm_first:  # post-norm: norm(x + f(x))
            attention = self._attention(x, position_embeddings, mask, causal)
            x = parts.attention_norm(x + self.attention_residual_dropout(attention))
            return parts.mlp_norm(x + self.mlp_residual_dropout(self._mlp(x)))
        normed = x if parts.attention_norm is None else parts.attention_norm(x)
        # One norm feeding both branches (Cohere, Phi): every input projection under one all-gather of it.
        shared = self.spec.parallel_residual and parts.mlp_norm is parts.attention_norm
        projected = column_parallel_linears(normed, [*parts.attention_in, *parts.mlp_in], self.group, self.sp) \
            if shared else None
        split = len(parts.attention_in)
        attention = self._attention(normed, position_embeddings, mask, causal, projected and projected[:split])
        if parts.attention_post_norm is not None:
            attention = parts.attention_post_norm(attention)
        attention = self._scaled(attention)
        if self.spec.parallel_residual:  # both branches read the block's input
            mlp = self._mlp(normed, projected[split:]) if shared else self._mlp(
                x if parts.mlp_norm is None else parts.mlp_norm(x))
            return x + self.attention_residual_dropout(attention) + self.mlp_residual_dropout(self._scaled(mlp))
        x = x + self.attention_residual_dropout(attention)
        mlp = self._mlp(x if parts.mlp_norm is None else parts.mlp_norm(x))
        if parts.mlp_post_norm is not None:
            mlp = parts.mlp_post_norm(mlp)
        return x + self.mlp_residual_dropout(self._scaled(mlp))  # [s/t, b, h]

    def _scaled(self, branch: Tensor) -> Tensor:
        """A branch's output as it joins the residual: times the residual multiplier, if any."""
        return branch if self.residual_multiplier is None else branch * self.residual_multiplier

    def _attention(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor],
                   causal: Optional[bool] = None, outputs: Optional[Sequence[Tensor]] = None) -> Tensor:
        """``outputs``: the input projections of ``x`` when computed already (one all-gather with the MLP's)."""
        parts = self._parts
        if outputs is None:
            outputs = column_parallel_linears(x, list(parts.attention_in), self.group, self.sp)  # each [s, b, ·/t]
        s, b = outputs[0].shape[:2]
        if len(outputs) == 1 and self.spec.qkv_per_head:  # this rank's key/value heads, each [q_g..; k_g; v_g]
            groups = self.heads_local // self.kv_heads_local
            grouped = outputs[0].view(s, b, self.kv_heads_local, groups + 2, self.head_dim)
            q, k, v = grouped[..., :groups, :].reshape(s, b, -1), grouped[..., groups, :], grouped[..., groups + 1, :]
        elif len(outputs) == 1:  # fused [q_r; k_r; v_r]
            kv_width = self.kv_heads_local * self.head_dim
            q, k, v = outputs[0].split([self.heads_local * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = outputs
        if self.spec.qk_norm_over_heads:  # over all heads: [s, b, a·d/t], the statistic summed over tp
            q = q if parts.q_norm is None else parts.q_norm(q)
            k = k if parts.k_norm is None else parts.k_norm(k)
        q = q.reshape(s, b, self.heads_local, self.head_dim)  # [s, b, a/t, d]
        k = k.reshape(s, b, self.kv_heads_local, self.head_dim)  # [s, b, a_kv/t, d]
        if not self.spec.qk_norm_over_heads:
            if parts.q_norm is not None:
                q = parts.q_norm(q)
            if parts.k_norm is not None:
                k = parts.k_norm(k)
        q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)  # [b, a/t, s, d], [b, a_kv/t, s, d]
        v = v.reshape(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)
        if self.rotary is not None and position_embeddings is not None:
            cos, sin = position_embeddings  # the whole sequence's positions
            rotated = cos.shape[-1]
            if rotated < self.head_dim:  # partial rotary: the first dims of each head turn, the rest pass
                q_turned, k_turned = self.rotary(q[..., :rotated], k[..., :rotated], cos, sin)
                q, k = torch.cat([q_turned, q[..., rotated:]], -1), torch.cat([k_turned, k[..., rotated:]], -1)
            else:
                q, k = self.rotary(q, k, cos, sin)
        if isinstance(mask, ContextParallelBatch):  # the sequence split over cp ranks: ring or all-to-all attention
            context = context_parallel_attention(q, k, v, mask, self.score_factor * self.head_dim**-0.5, self.softcap,
                                                 fused=self.fused_attention)
            return parts.attention_out(merge_heads(context))
        groups = self.heads_local // self.kv_heads_local
        if self.implementation == "sdpa":  # takes the mask as given: bool (True = attend) or additive
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=(mask is None and self.spec.causal) if causal is None else causal,
                scale=self.score_factor * self.head_dim**-0.5,
                enable_gqa=groups > 1,
            )
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, a/t, s, d]
            assert self.core_attention is not None
            context = self.core_attention(q * self.score_factor if self.score_factor != 1.0 else q, k, v, mask, causal)
        return parts.attention_out(merge_heads(context))  # [s/t, b, h] under SP

    def _mlp(self, x: Tensor, outputs: Optional[Sequence[Tensor]] = None) -> Tensor:
        if outputs is None:
            outputs = column_parallel_linears(x, list(self._parts.mlp_in), self.group, self.sp)  # each [s, b, f/t]
        if self.spec.gate_up:  # fused [gate_r; up_r]
            outputs = outputs[0].chunk(2, dim=-1)
        inner = self.activation(outputs[0]) * outputs[1] if len(outputs) == 2 else self.activation(outputs[0])
        if self.mlp_inner_dropout is not None:
            inner = self.mlp_inner_dropout(inner)
        return self._parts.mlp_out(inner)


CACHE_MARK = "tensor_parallel_layers_seen"
"""Attribute set on a key/value cache object: the ids of the parallel layers that were called with it."""


def refuse_used_cache(layer: nn.Module, cache: Any) -> None:
    """Let a forward through with a key/value cache only when no past is read from it.

    A Hugging Face model makes a new, empty cache for every call with ``use_cache=True`` (its config's default):
    a training or validation forward then reads nothing from it, and the layer keeps no keys/values in it (it
    computes no differently). A cache holding tokens (``past_key_values`` passed in), or one this layer has
    already seen (generation reuses the cache of the previous step, which the layer left empty), would make the
    layer attend to past tokens it does not have: refused. Costs no device synchronization (a cache's length is a
    shape).

    Raises:
        NotImplementedError: naming the fix (``use_cache=False``, or generating from a single-device model).
    """
    if cache is None:
        return
    seen = getattr(cache, CACHE_MARK, None)
    length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else None
    if length is None or length > 0 or (seen is not None and id(layer) in seen):
        raise NotImplementedError(
            f"{getattr(layer, '_name', type(layer).__name__)} was called with a key/value cache holding past tokens "
            f"(cache= / past_key_values=, or "
            f"generation): a tensor-parallel block keeps no key/value cache. Train and evaluate without passing "
            f"past_key_values (use_cache=False, or the config's default, is fine); generate from the single-device "
            f"model (e.g. lightning_seqpar.checkpoint.consolidate, or the strategy's full_state_dict())."
        )
    if seen is None:
        seen = set()
        setattr(cache, CACHE_MARK, seen)
    seen.add(id(layer))
