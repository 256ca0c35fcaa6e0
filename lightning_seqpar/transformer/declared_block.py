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

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention, merge_heads
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region
from lightning_seqpar.transformer.roles import LayerDims, ParallelLayer

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class BlockSpec:
    """Which submodules of a pre-norm transformer block play which part (dotted paths inside the block).

    Attributes:
        attention_norm: the norm before attention (LayerNorm, RMSNorm, ...; joins the sequence-parallel region).
        mlp_norm: the norm before the MLP (joins the sequence-parallel region).
        attention_out: the attention output projection (``nn.Linear``, row-parallel).
        mlp_out: the MLP output projection (``nn.Linear``, row-parallel).
        num_heads: the query head count: an ``int``, or the path of the attribute holding it (e.g.
            ``"attn.n_head"``, ``"self_attn.config.num_attention_heads"``).
        qkv: a fused ``[q; k; v]`` projection (``nn.Linear``, column-parallel, split per head block); or
        q, k, v: three separate projections (column-parallel, one all-gather for the three).
        mlp_in: the MLP input projection (column-parallel); or
        gate, up: a gated MLP, ``act(gate(x)) · up(x)`` (SwiGLU; column-parallel, one all-gather).
        activation: the path of the activation (a module or a function attribute, e.g. ``"mlp.gelu"``,
            ``"mlp.act_fn"``), or a name of ``torch.nn.functional`` prefixed ``"F."`` (``"F.gelu"``).
        num_kv_heads: key/value heads of grouped-query attention (int or attribute path); default ``num_heads``.
        head_dim: per-head size (int or attribute path); default ``hidden_size // num_heads``.
        attention_dropout: dropout on the attention probabilities: a float, or the path of an ``nn.Dropout``
            or of a float attribute.
        residual_dropouts: paths of the ``nn.Dropout`` after ``attention_out`` and after ``mlp_out`` (0 or 2).
        rotary: name of a function ``(q, k, cos, sin) -> (q, k)`` in the block's own Python module, applied to
            q and k when the caller passes ``position_embeddings=(cos, sin)`` (Hugging Face's ``apply_rotary_pos_emb``).
        causal: mask future positions when no ``attention_mask`` is passed.
        attention: ``"eager"`` (explicit core attention: selective recomputation applies) or ``"sdpa"`` (fused,
            keeps no s² tensor); or the path of an attribute holding one of them.
        softmax_dtype: dtype of the eager softmax (``torch.float32`` as Hugging Face computes it); default the
            scores' dtype.
        scaling: attention score scale: a float, or the path of a float attribute; default ``head_dim ** -0.5``.
        transposed: the projections store their weights ``[in, out]`` (Hugging Face's ``Conv1D``, GPT-2);
            shards keep that layout, so state-dict shapes stay the original's.
        mask_position: where the caller passes the attention mask among the positional arguments after the
            hidden states (GPT-2's blocks get ``(hidden, past_key_values, mask, ...)``: 1); default: keyword only.
    """

    attention_norm: str
    mlp_norm: str
    attention_out: str
    mlp_out: str
    num_heads: Union[int, str]
    activation: str
    qkv: Optional[str] = None
    q: Optional[str] = None
    k: Optional[str] = None
    v: Optional[str] = None
    mlp_in: Optional[str] = None
    gate: Optional[str] = None
    up: Optional[str] = None
    num_kv_heads: Union[int, str, None] = None
    head_dim: Union[int, str, None] = None
    attention_dropout: Union[float, str] = 0.0
    residual_dropouts: tuple[str, ...] = ()
    rotary: Optional[str] = None
    causal: bool = True
    attention: str = "eager"
    softmax_dtype: Optional[torch.dtype] = None
    scaling: Union[float, str, None] = None
    transposed: bool = False
    mask_position: Optional[int] = None

    def projections(self) -> tuple[list[str], list[str]]:
        """The column-parallel paths of the attention input and of the MLP input."""
        attention = [self.qkv] if self.qkv else [p for p in (self.q, self.k, self.v) if p]
        mlp = [self.mlp_in] if self.mlp_in else [p for p in (self.gate, self.up) if p]
        return attention, mlp

    def paths(self) -> dict[str, str]:
        """Every submodule path the declaration names, by role."""
        attention, mlp = self.projections()
        named = {"attention_norm": self.attention_norm, "mlp_norm": self.mlp_norm,
                 "attention_out": self.attention_out, "mlp_out": self.mlp_out}
        named.update({f"attention input {i}": p for i, p in enumerate(attention)})
        named.update({f"mlp input {i}": p for i, p in enumerate(mlp)})
        named.update({f"residual dropout {i}": p for i, p in enumerate(self.residual_dropouts)})
        return named


def resolve(block: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` inside ``block``.

    Raises:
        AttributeError: naming the first missing part and what exists there.
    """
    value: Any = block
    done = []
    for part in path.split("."):
        if not hasattr(value, part):
            where = ".".join(done) or type(block).__name__
            children = sorted(n for n, _ in value.named_children()) if isinstance(value, nn.Module) else []
            raise AttributeError(f"'{path}': {where} has no '{part}' (its submodules: {children}).")
        value = getattr(value, part)
        done.append(part)
    return value


def value_of(block: nn.Module, spec_value: Union[int, float, str, None]) -> Any:
    """An ``int``/``float`` as given; a string as the attribute it names."""
    return resolve(block, spec_value) if isinstance(spec_value, str) else spec_value


def _activation(block: nn.Module, spec: BlockSpec) -> Callable[[Tensor], Tensor]:
    if spec.activation.startswith("F."):
        return getattr(F, spec.activation[2:])
    return resolve(block, spec.activation)


def out_features(module: nn.Module) -> int:
    """Output features of an ``nn.Linear`` or of a ``Conv1D`` (weight ``[in, out]``)."""
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    target = root
    for part in filter(None, parent.split(".")):
        if not hasattr(target, part):
            target.add_module(part, nn.Module())
        target = getattr(target, part)
    target.add_module(name, module)


class ParallelBlock(ParallelLayer):
    """The tensor (+sequence) parallel version of a block described by a :class:`BlockSpec`.

    Args:
        block: the single-device block; its norms (and activation module) are reused, its weights sliced.
        spec: the declaration.
        ctx: rewrite context.
        enter_region / exit_region: this block starts / ends the parallel region (``[b, s, h]`` batch-first
            outside it).

    Shapes: ``hidden_states`` ``[b, s, h]`` at a region boundary, ``[s/t, b, h]`` (SP) or ``[s, b, h]``
    between rewritten blocks; q ``[b, a/t, s, d]``, k/v ``[b, a_kv/t, s, d]``; output like the input.

    Raises:
        NotImplementedError: called with a key/value cache (training only).
    """

    def __init__(self, block: nn.Module, spec: BlockSpec, ctx: RewriteContext, *, enter_region: bool = True,
                 exit_region: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.enter_region, self.exit_region = enter_region, exit_region
        self.spec = spec
        attention, mlp = spec.projections()
        self.num_heads = value_of(block, spec.num_heads)
        self.num_kv_heads = value_of(block, spec.num_kv_heads) or self.num_heads
        hidden = out_features(resolve(block, spec.attention_out))
        self.head_dim = value_of(block, spec.head_dim) or hidden // self.num_heads
        self.heads_local, self.kv_heads_local = self.num_heads // ctx.tp, self.num_kv_heads // ctx.tp
        scaling = value_of(block, spec.scaling)
        self.score_factor = 1.0 if scaling is None else float(scaling) * self.head_dim**0.5  # CoreAttention uses 1/√d
        chunks = 3 if spec.qkv else 1
        column = ColumnParallelLinear.from_conv1d if spec.transposed else ColumnParallelLinear.from_linear
        row = RowParallelLinear.from_conv1d if spec.transposed else RowParallelLinear.from_linear
        for path in attention:
            _set(self, path, column(resolve(block, path), ctx.group, sequence_parallel=ctx.sp, chunks=chunks))
        for path in mlp:
            _set(self, path, column(resolve(block, path), ctx.group, sequence_parallel=ctx.sp))
        for path in (spec.attention_out, spec.mlp_out):
            _set(self, path, row(resolve(block, path), ctx.group, sequence_parallel=ctx.sp))
        for path in (spec.attention_norm, spec.mlp_norm):
            norm = resolve(block, path)
            if ctx.sp:
                mark_sequence_parallel(norm)
            _set(self, path, norm)
        self.attention_projections = attention
        self.mlp_projections = mlp
        self.activation = _activation(block, spec)
        dropout = value_of(block, spec.attention_dropout)
        dropout = dropout.p if isinstance(dropout, nn.Dropout) else float(dropout or 0.0)
        self.implementation = value_of(block, spec.attention) if "." in spec.attention else spec.attention
        self.dropout_p = dropout
        self.fused_attention = self.implementation == "sdpa"
        # Only the explicit path has a CoreAttention for selective recomputation to checkpoint.
        self.core_attention = None if self.fused_attention else CoreAttention(
            dropout, rng_tracker=ctx.rng_tracker, sharded_heads=ctx.tp > 1, softmax_dtype=spec.softmax_dtype)
        drops = [resolve(block, p).p for p in spec.residual_dropouts] or [0.0, 0.0]
        self.attention_residual_dropout = ParallelDropout(drops[0], ctx.rng_tracker, sharded=ctx.sp)
        self.mlp_residual_dropout = ParallelDropout(drops[1], ctx.rng_tracker, sharded=ctx.sp)
        self.rotary = getattr(sys.modules[type(block).__module__], spec.rotary) if spec.rotary else None
        ffn = out_features(resolve(block, mlp[0]))
        self._dims = LayerDims(hidden, self.num_heads, ffn, ctx.tp, ctx.sp)

    def layer_dims(self) -> LayerDims:
        return self._dims

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Optional[Tensor] = None,
                position_embeddings: Optional[tuple[Tensor, Tensor]] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = False, **kwargs: Any) -> Tensor:
        if self.spec.mask_position is not None and len(args) > self.spec.mask_position:
            attention_mask = args[self.spec.mask_position]
        if self.spec.mask_position is not None and args and args[0] is not None and self.spec.mask_position > 0:
            past_key_values = args[0]  # (hidden, past_key_values, mask, ...)
        if past_key_values is not None or use_cache:
            raise NotImplementedError("A tensor-parallel block keeps no key/value cache: call the model with "
                                      "use_cache=False (training), or generate from the single-device model.")
        x = enter_parallel_region(hidden_states, self.group, self.sp, True) if self.enter_region else hidden_states
        if self.recompute_layer and torch.is_grad_enabled():
            x = recomputed(self._body, x, position_embeddings, attention_mask, rng_tracker=self.rng_tracker)
        else:
            x = self._body(x, position_embeddings, attention_mask)
        return exit_parallel_region(x, self.group, self.sp, True) if self.exit_region else x

    def _body(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor]) -> Tensor:
        attention_norm, mlp_norm = self.get_submodule(self.spec.attention_norm), self.get_submodule(self.spec.mlp_norm)
        x = x + self.attention_residual_dropout(self._attention(attention_norm(x), position_embeddings, mask))
        return x + self.mlp_residual_dropout(self._mlp(mlp_norm(x)))  # [s/t, b, h]

    def _attention(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor]) -> Tensor:
        layers = [self.get_submodule(p) for p in self.attention_projections]
        outputs = column_parallel_linears(x, layers, self.group, self.sp)  # each [s, b, ·/t]
        s, b = outputs[0].shape[:2]
        if len(outputs) == 1:  # fused [q_r; k_r; v_r]
            q, k, v = outputs[0].view(s, b, 3, -1).unbind(2)
        else:
            q, k, v = outputs
        q = q.reshape(s, b, self.heads_local, self.head_dim).permute(1, 2, 0, 3)  # [b, a/t, s, d]
        k = k.reshape(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)  # [b, a_kv/t, s, d]
        v = v.reshape(s, b, self.kv_heads_local, self.head_dim).permute(1, 2, 0, 3)
        if self.rotary is not None and position_embeddings is not None:
            cos, sin = position_embeddings  # the whole sequence's positions
            q, k = self.rotary(q, k, cos, sin)
        groups = self.heads_local // self.kv_heads_local
        if self.implementation == "sdpa":  # takes the mask as given: bool (True = attend) or additive
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=mask is None and self.spec.causal, scale=self.score_factor * self.head_dim**-0.5,
                enable_gqa=groups > 1,
            )
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, a/t, s, d]
            bias = additive_mask(mask, q.dtype)
            if bias is None and self.spec.causal:
                bias = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
            assert self.core_attention is not None
            context = self.core_attention(q * self.score_factor if self.score_factor != 1.0 else q, k, v, bias)
        return self.get_submodule(self.spec.attention_out)(merge_heads(context))  # [s/t, b, h] under SP

    def _mlp(self, x: Tensor) -> Tensor:
        layers = [self.get_submodule(p) for p in self.mlp_projections]
        outputs = column_parallel_linears(x, layers, self.group, self.sp)  # each [s, b, f/t]
        inner = self.activation(outputs[0]) * outputs[1] if len(outputs) == 2 else self.activation(outputs[0])
        return self.get_submodule(self.spec.mlp_out)(inner)


def additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A Hugging Face attention mask (``[b, 1, s, s]``; bool with ``True`` = attend, or additive float) as an
    additive bias for :class:`CoreAttention`."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
