"""The attention part of the parallel block: its declaration (:class:`AttentionSpec`) and what it builds
(:class:`AttentionPart`): norm → column-parallel q/k/v → core attention → row-parallel output.

Megatron-Core's ``SelfAttentionSubmodules`` (``linear_qkv``, ``core_attention``, ``linear_proj``, ``q_layernorm``,
``k_layernorm``) as a declaration of a user's block: each field names the submodule of the user's block that plays
the part, or a value. q/k/v are split over t ranks by heads (grouped-query attention included: a/t query and
a_kv/t key/value heads per rank); the projections keep the user's paths, so state-dict keys are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.context_parallel import ContextParallelBatch, check_all_to_all_heads, context_parallel_attention
from lightning_seqpar.tensor_parallel.layers import column_parallel_linears
from lightning_seqpar.tensor_parallel.norms import LocalHeadsNorm, TensorParallelRMSNorm, per_head_weights
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.parallel.placement import set_sequence_parallel
from lightning_seqpar.transformer.core_attention import CoreAttention, merge_heads
from lightning_seqpar.transformer.part_builder import PartBuilder
from lightning_seqpar.transformer.paths import resolve


@dataclass(frozen=True)
class AttentionSpec:
    """Which submodules of a block make its attention, and how it attends (dotted paths inside the block; a value
    given as a string names the attribute holding it).

    Attributes:
        attention_norm: the norm before attention (joins the sequence-parallel region); ``None``: none.
        attention_out: the output projection (``nn.Linear``, row-parallel).
        num_heads: query heads a.
        qkv: a fused ``[q; k; v]`` projection (``nn.Linear``, column-parallel, split per head block; or an
            ``nn.MultiheadAttention``, whose packed ``in_proj_weight`` is that projection); or
        q, k, v: three separate projections (column-parallel, one all-gather for the three).
        qkv_per_head: the fused projection's rows are grouped by key/value head (Falcon's new architecture; GPT-NeoX
            and Falcon without grouping): for each key/value head g, its ``a/a_kv`` query heads, ``k_g``, ``v_g``.
        qk_norm_over_heads: ``q_norm`` / ``k_norm`` normalize the whole projection (OLMo 2): the weight sharded, the
            mean of squares summed over tp (:class:`~lightning_seqpar.tensor_parallel.norms.TensorParallelRMSNorm`).
        num_kv_heads: key/value heads a_kv (default ``num_heads``).
        head_dim: d (default ``hidden_size // num_heads``).
        attention_dropout: dropout on the attention probabilities: a float, or the path of an ``nn.Dropout`` or of
            a float attribute.
        rotary: a function ``(q, k, cos, sin) -> (q, k)`` (or its name in the block's own Python module), applied
            when the caller passes ``position_embeddings=(cos, sin)``.
        rotary_dims: the leading dims of each head the rotary function turns, the rest passing through (partial
            rotary); default: as many as ``cos`` has columns. gpt-oss's cos/sin have ``d/2`` columns and turn all d.
        causal: mask future positions when no mask is passed.
        implementation: ``"eager"`` (explicit core attention: selective recomputation applies) or ``"sdpa"``
            (fused); or the path of an attribute holding one of them (the flat declaration's ``attention=``).
        softmax_dtype: dtype of the eager softmax (default the scores' dtype).
        scaling: score scale: a float or a float attribute's path; default ``head_dim ** -0.5``.
        q_norm, k_norm: norms of each query / key head after the projection, before the rotary embedding (Qwen3);
            replicated, gradients summed over tp; a weight per head (Cohere, StableLM) applies this rank's heads'.
        attention_post_norm: a norm on the attention output before the residual (Gemma 2/3); sequence-parallel.
        attention_softcap: ``cap · tanh(scores / cap)`` before the mask (Gemma 2); explicit attention only.
        sliding_window: the attention window w, read under context parallelism only (the ring masks it itself).
        sinks: the path of a learned sink logit per query head, ``[a]`` (gpt-oss): one more softmax column per row,
            dropped before ``· V``. The parameter stays whole on every rank, each using its ``a/t`` heads' entries,
            its gradient summed over tp; explicit attention only (the fused kernel has no sinks).
        layer_index: the layer's slot in a key/value cache (an int, or the path of one: Hugging Face's
            ``self_attn.layer_idx``); ``None``: the block refuses a cache (:mod:`~.kv_cache`).
    """

    attention_norm: Optional[str]
    attention_out: str
    num_heads: Union[int, str]
    qkv: Optional[str] = None
    q: Optional[str] = None
    k: Optional[str] = None
    v: Optional[str] = None
    qkv_per_head: bool = False
    qk_norm_over_heads: bool = False
    num_kv_heads: Union[int, str, None] = None
    head_dim: Union[int, str, None] = None
    attention_dropout: Union[float, str] = 0.0
    rotary: Union[str, Callable[..., Any], None] = None
    rotary_dims: Union[int, str, None] = None
    causal: bool = True
    implementation: str = "eager"
    softmax_dtype: Optional[torch.dtype] = None
    scaling: Union[float, str, None] = None
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    attention_post_norm: Optional[str] = None
    attention_softcap: Union[float, str, None] = None
    sliding_window: Union[int, str, None] = None
    sinks: Optional[str] = None
    layer_index: Union[int, str, None] = None

    def inputs(self) -> list[str]:
        """The column-parallel input projections' paths (one all-gather for all)."""
        return [self.qkv] if self.qkv else [p for p in (self.q, self.k, self.v) if p]

    def paths(self) -> dict[str, str]:
        """Every submodule (or parameter: the sinks) path the part names, by role."""
        named = {role: p for role, p in (("attention_norm", self.attention_norm), ("attention_out", self.attention_out))
                 if p}
        named.update({f"attention input {i}": p for i, p in enumerate(self.inputs())})
        named.update({role: p for role, p in (("q_norm", self.q_norm), ("k_norm", self.k_norm),
                                              ("attention_post_norm", self.attention_post_norm),
                                              ("sinks", self.sinks)) if p})
        return named

    def build(self, builder: PartBuilder) -> "AttentionPart":
        return AttentionPart(self, builder)


class AttentionPart:
    """The attention of one :class:`~lightning_seqpar.transformer.declared_block.ParallelBlock`, built from an
    :class:`AttentionSpec`. Its modules are registered on the block under the user's paths (and ``core_attention``),
    so the block's state dict and module tree are the user's block's.

    Shapes: ``forward(x)`` ``[s/t, b, h]`` (SP) or ``[s, b, h]`` in and out; q ``[b, a/t, s, d]``, k/v
    ``[b, a_kv/t, s, d]`` inside.

    Raises:
        ValueError: from :meth:`check_context_parallel`.
    """

    def __init__(self, spec: AttentionSpec, builder: PartBuilder) -> None:
        ctx = builder.ctx
        self.spec, self.name, self.group, self.sp = spec, builder.name, ctx.group, ctx.sp
        self.num_heads = builder.value(spec.num_heads)
        self.num_kv_heads = builder.value(spec.num_kv_heads) or self.num_heads
        self.hidden = builder.out_features(spec.attention_out)
        self.head_dim = builder.value(spec.head_dim) or self.hidden // self.num_heads
        self.heads_local, self.kv_heads_local = self.num_heads // ctx.tp, self.num_kv_heads // ctx.tp
        scaling = builder.value(spec.scaling)
        self.score_factor = 1.0 if scaling is None else float(scaling) * self.head_dim**0.5  # CoreAttention uses 1/√d
        # Fused [q; k; v]: each of the three split over tp (per head: whole heads are contiguous rows).
        sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        chunks = sizes if spec.qkv and not spec.qkv_per_head else 1
        self.inputs = tuple(builder.column(p, "attention input", chunks) for p in spec.inputs())
        self.out = builder.row(spec.attention_out, "attention out")
        self.norm = builder.norm(spec.attention_norm, "attention norm")
        self.post_norm = builder.norm(spec.attention_post_norm, "attention post norm")
        self.q_norm = self._head_norm(builder, spec.q_norm, self.num_heads, self.heads_local, "q norm")
        self.k_norm = self._head_norm(builder, spec.k_norm, self.num_kv_heads, self.kv_heads_local, "k norm")
        self.dropout_p = _dropout_p(builder.value(spec.attention_dropout))
        self.implementation = builder.value(spec.implementation) if "." in spec.implementation else spec.implementation
        self.fused = self.implementation == "sdpa" and not spec.sinks
        self.sinks = self._sinks(builder, spec.sinks)
        softcap = builder.value(spec.attention_softcap)
        self.softcap = None if softcap is None else float(softcap)
        # Only the explicit path has a CoreAttention for selective recomputation to checkpoint.
        self.core_attention = None if self.fused else builder.host_module("core_attention", CoreAttention(
            self.dropout_p, causal=spec.causal, rng_tracker=ctx.rng_tracker, sharded_heads=ctx.tp > 1,
            softmax_dtype=spec.softmax_dtype, softcap=self.softcap), "core attention")
        self.rotary = builder.rotary(spec.rotary)
        self.rotary_dims = builder.value(spec.rotary_dims)
        self.window = builder.value(spec.sliding_window)
        self.layer_index = builder.value(spec.layer_index)
        if ctx.cp > 1:
            self.check_context_parallel(ctx.cp, ctx.context.comm)

    def _sinks(self, builder: PartBuilder, path: Optional[str]) -> Optional[slice]:
        """The user's sink logits, kept whole under their path (summed over tp: each rank's gradient is of its heads);
        this rank's heads' entries."""
        if not path:
            return None
        sinks = builder.resolve(path)
        if not isinstance(sinks, nn.Parameter) or sinks.shape != (self.num_heads,):
            raise ValueError(f"{self.name}: the attention sinks at {path} must be a parameter of one logit per query "
                             f"head, [{self.num_heads}]; found {type(sinks).__name__} "
                             f"{tuple(getattr(sinks, 'shape', ()))}.")
        set_sequence_parallel(sinks)
        builder.place_parameter(path, sinks, "attention sinks")
        # Looked up on the block at each call (materialization replaces the parameter object); the block itself, not a
        # closure, so that a copy of the block (deepcopy, pickle) reads its own.
        self.sink_host, self.sink_path = builder.host, path
        first = builder.ctx.group.rank * self.heads_local
        return slice(first, first + self.heads_local)

    def _head_norm(self, builder: PartBuilder, path: Optional[str], heads: int, local: int, role: str) -> Any:
        norm = builder.resolve(path) if path else None
        if norm is None:
            return None
        if self.spec.qk_norm_over_heads:  # over all heads: features split over tp
            return builder.place(path, TensorParallelRMSNorm(norm, builder.ctx.group), role)
        for module in norm.modules():  # per-head norms, replicated: each rank's gradient is of a share of the heads
            mark_sequence_parallel(module)
        builder.place(path, norm, role)
        if per_head_weights(norm, heads):  # a weight of its own per head: this rank's heads' weights
            return LocalHeadsNorm(norm, builder.ctx.group.rank * local, local)
        return norm

    def check_context_parallel(self, cp: int, comm: str) -> None:
        """What context-parallel attention computes exactly, or a refusal naming the part and the fix.

        Raises:
            ValueError: attention-probability dropout (its masks would be drawn per ring block), a block that is not
                causal, or all-to-all attention with local head counts that do not divide by c.
        """
        if self.dropout_p > 0:
            raise ValueError(f"{self.name}: attention dropout p={self.dropout_p} under context parallelism (cp="
                             f"{cp}) is not supported: the ring computes attention block by block. Set the model's "
                             f"attention dropout to 0 (attention_dropout / attn_pdrop), as modern recipes do.")
        if not self.spec.causal:
            raise ValueError(f"{self.name}: context parallelism here balances causal attention; this block is "
                             f"declared non-causal (BlockSpec.causal=False). Train it without cp.")
        if comm == "all_to_all":
            check_all_to_all_heads(self.heads_local, self.kv_heads_local, cp, self.name)

    def forward(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor],
                causal: Optional[bool] = None, outputs: Optional[Sequence[Tensor]] = None,
                training: bool = False, layout: Optional[ContextParallelBatch] = None) -> Tensor:
        """Attention of the normed ``x`` (its input projections ``outputs`` when computed already: one all-gather with
        the MLP's), through the output projection (``[s/t, b, h]`` under SP; the post-norm, if any, applied).
        ``layout``: the forward's context-parallel layout (or packed documents), which then masks instead of
        ``mask``/``causal``."""
        q, k, v = self.qkv(x, position_embeddings, outputs)
        return self.output(self.attend(q, k, v, mask, causal, training, layout))

    def qkv(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]],
            outputs: Optional[Sequence[Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[b, a/t, s, d]``, k and v ``[b, a_kv/t, s, d]`` of the normed ``x`` (``[s/t, b, h]`` under SP; or its
        projections ``outputs``), normed per head and rotated."""
        if outputs is None:
            outputs = column_parallel_linears(x, list(self.inputs), self.group, self.sp)  # each [s, b, ·/t]
        q, k, v = self._heads(outputs)
        q, k = self.rotate(q, k, position_embeddings)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: Optional[bool],
               training: bool, layout: Optional[ContextParallelBatch]) -> Tensor:
        """The core attention ``[b, a/t, s, d]``: across the cp ranks (ring or all-to-all) or within packed documents
        when ``layout`` is given, else masked by ``mask``/``causal``."""
        if layout is not None:
            return context_parallel_attention(q, k, v, layout, self.score_factor * self.head_dim**-0.5, self.softcap,
                                              fused=self.fused, sinks=self._local_sinks())
        return self._attend(q, k, v, mask, causal, training)

    def output(self, context: Tensor) -> Tensor:
        """The output projection of the core attention's ``context`` (``[s/t, b, h]`` under SP; the post-norm, if
        any, applied)."""
        out = self.out(merge_heads(context))
        return out if self.post_norm is None else self.post_norm(out)

    def _heads(self, outputs: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[b, a/t, s, d]``, k and v ``[b, a_kv/t, s, d]`` from the projections, normed and rotated."""
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
            q = q if self.q_norm is None else self.q_norm(q)
            k = k if self.k_norm is None else self.k_norm(k)
        q = q.reshape(s, b, self.heads_local, self.head_dim)  # [s, b, a/t, d]
        k = k.reshape(s, b, self.kv_heads_local, self.head_dim)  # [s, b, a_kv/t, d]
        if not self.spec.qk_norm_over_heads:
            q = q if self.q_norm is None else self.q_norm(q)
            k = k if self.k_norm is None else self.k_norm(k)
        q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)  # [b, a/t, s, d], [b, a_kv/t, s, d]
        v = v.reshape(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)
        return q, k, v

    def rotate(self, q: Tensor, k: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]]
               ) -> tuple[Tensor, Tensor]:
        """q and k turned by the rotary embedding of the whole sequence's positions (partial rotary: the first
        dims of each head turn, the rest pass)."""
        if self.rotary is None or position_embeddings is None:
            return q, k
        cos, sin = position_embeddings
        rotated = self.rotary_dims or cos.shape[-1]
        if rotated < self.head_dim:
            q_turned, k_turned = self.rotary(q[..., :rotated], k[..., :rotated], cos, sin)
            return torch.cat([q_turned, q[..., rotated:]], -1), torch.cat([k_turned, k[..., rotated:]], -1)
        return self.rotary(q, k, cos, sin)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: Optional[bool],
                training: bool) -> Tensor:
        groups = self.heads_local // self.kv_heads_local
        if self.implementation == "sdpa":  # takes the mask as given: bool (True = attend) or additive
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout_p if training else 0.0,
                is_causal=(mask is None and self.spec.causal) if causal is None else causal,
                scale=self.score_factor * self.head_dim**-0.5, enable_gqa=groups > 1)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, a/t, s, d]
        assert self.core_attention is not None
        return self.core_attention(q * self.score_factor if self.score_factor != 1.0 else q, k, v, mask, causal,
                                   self._local_sinks())

    def _local_sinks(self) -> Optional[Tensor]:
        """This rank's heads' sink logits ``[a/t]`` (a view: the gradient reaches the whole parameter's entries)."""
        return None if self.sinks is None else resolve(self.sink_host, self.sink_path)[self.sinks]


def _dropout_p(value: Any) -> float:
    return value.p if isinstance(value, nn.Dropout) else float(value or 0.0)

