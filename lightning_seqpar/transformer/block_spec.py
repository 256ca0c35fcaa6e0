"""A declaration of a pre-norm transformer block: which of its submodules plays which part (:class:`BlockSpec`),
and the checks that the declaration names every part the block has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import sys

import torch
import torch.nn as nn

from lightning_seqpar.transformer.tuner_layers import linear_of

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class BlockSpec:
    """Which submodules of a pre-norm transformer block play which part (dotted paths inside the block).

    Attributes:
        attention_norm: the norm before attention (LayerNorm, RMSNorm, ...; joins the sequence-parallel region);
            ``None``: none (OLMo 2 normalizes the branch outputs only, ``attention_post_norm``).
        mlp_norm: the norm before the MLP (joins the sequence-parallel region); ``None``: none.
        attention_out: the attention output projection (``nn.Linear``, row-parallel).
        mlp_out: the MLP output projection (``nn.Linear``, row-parallel).
        num_heads: the query head count: an ``int``, or the path of the attribute holding it (e.g.
            ``"attn.n_head"``, ``"self_attn.config.num_attention_heads"``).
        qkv: a fused ``[q; k; v]`` projection (``nn.Linear``, column-parallel, split per head block; or an
            ``nn.MultiheadAttention``, whose packed ``in_proj_weight`` is that projection); or
        q, k, v: three separate projections (column-parallel, one all-gather for the three).
        qkv_per_head: the fused projection's rows are grouped by key/value head rather than ``[q; k; v]``: for each
            key/value head g, its ``a/a_kv`` query heads, then ``k_g``, then ``v_g`` (Falcon's new architecture;
            GPT-NeoX and Falcon without grouping, ``a_kv = a``: ``[q_h; k_h; v_h]`` per head); split over t ranks by
            whole groups.
        mlp_in: the MLP input projection (column-parallel); or
        gate, up: a gated MLP, ``act(gate(x)) · up(x)`` (SwiGLU; column-parallel, one all-gather); or
        gate_up: the two fused as one ``[gate; up]`` projection (Phi-3, GLM), split per rank as ``[gate_r; up_r]`` so
            checkpoints and exports keep the fused layout.
        activation: the path of the activation (a module or a function attribute, e.g. ``"mlp.gelu"``,
            ``"mlp.act_fn"``), or a name of ``torch.nn.functional`` prefixed ``"F."`` (``"F.gelu"``).
        num_kv_heads: key/value heads of grouped-query attention (int or attribute path); default ``num_heads``.
        head_dim: per-head size (int or attribute path); default ``hidden_size // num_heads``.
        attention_dropout: dropout on the attention probabilities: a float, or the path of an ``nn.Dropout``
            or of a float attribute.
        residual_dropouts: paths of the ``nn.Dropout`` after ``attention_out`` and after ``mlp_out`` (0 or 2).
        rotary: a function ``(q, k, cos, sin) -> (q, k)`` (or its name in the block's own Python module), applied to
            q and k when the caller passes ``position_embeddings=(cos, sin)`` (Hugging Face's ``apply_rotary_pos_emb``).
        causal: mask future positions when no ``attention_mask`` is passed.
        attention: ``"eager"`` (explicit core attention: selective recomputation applies) or ``"sdpa"`` (fused,
            keeps no s² tensor); or the path of an attribute holding one of them.
        softmax_dtype: dtype of the eager softmax (``torch.float32`` as Hugging Face computes it); default the
            scores' dtype.
        scaling: attention score scale: a float, or the path of a float attribute; default ``head_dim ** -0.5``.
        transposed: the projections store their weights ``[in, out]`` (Hugging Face's ``Conv1D``, GPT-2);
            shards keep that layout, so state-dict shapes stay the original's.
        arguments: the names of the positional arguments the model passes after the hidden states, in order
            (GPT-2's model calls ``block(hidden, cache, mask, encoder_hidden_states, ...)``: ``("cache",
            "attention_mask", "encoder_hidden_states")``); default none, every other argument by keyword. Names and
            what the parallel block does with each: :mod:`lightning_seqpar.transformer.block_arguments`; any other
            argument that is not ``None`` is refused by name.
        norm_first: pre-norm (``x + f(norm(x))``, the default) or post-norm (``norm(x + f(x))``, the original
            Transformer's and torch's ``norm_first=False``): a bool, or the path of a bool attribute.
        mlp_dropout: the path of an ``nn.Dropout`` between the activation and ``mlp_out`` (torch's encoder layer
            ``dropout``); it sees ``[s, b, ffn/t]`` features, so each rank draws its own mask.
        batch_first: the block's input and output are ``[b, s, h]`` (default) or ``[s, b, h]`` where the parallel
            region starts or ends: a bool, or the path of a bool attribute (``"self_attn.batch_first"``).
        parallel_residual: attention and MLP both read the block's input and both join the residual,
            ``x + attn(norm1(x)) + mlp(norm2(x))`` (Cohere with one norm, ``mlp_norm`` = ``attention_norm``; GPT-NeoX
            with two); pre-norm only.
        attention_post_norm, mlp_post_norm: norms applied to the attention / MLP output before it joins the
            residual (``x + post_norm(f(norm(x)))``: Gemma 2/3's ``post_attention_layernorm`` and
            ``post_feedforward_layernorm``); on ``[s/t, b, h]`` shards under SP, their weights sequence-parallel.
        attention_softcap: attention-logit soft-capping, ``cap · tanh(scores / cap)`` before the mask (Gemma 2's
            ``attn_logit_softcapping``): a float, or the path of a float attribute; ``None``: none. Explicit
            attention only (a fused kernel has no soft-cap).
        residual_multiplier: each branch's output is scaled by it before joining the residual,
            ``x + m · f(norm(x))`` (Granite's ``residual_multiplier``): a float, or the path of a float attribute;
            ``None``: 1.
        qk_norm_over_heads: ``q_norm`` / ``k_norm`` normalize the whole projection (all heads together, OLMo 2), an
            RMSNorm over features split across tp: its weight is sharded and the mean of squares summed over tp
            (:class:`~lightning_seqpar.tensor_parallel.norms.TensorParallelRMSNorm`).
        q_norm, k_norm: norms applied to each query / key head (over ``head_dim``) after the projection and before
            the rotary embedding (Qwen3, OLMo-2 style). Their weights are replicated; each rank normalizes a share
            of the heads, so their gradients are summed over the tensor-parallel group. A norm with a weight of its
            own per head (a ``[a, d]`` weight, Cohere's ``use_qk_norm``; or a ``ModuleList`` ``norms`` of one
            ``nn.LayerNorm`` per head, StableLM's ``qk_layernorm``) applies this rank's heads' weights
            (:class:`~lightning_seqpar.tensor_parallel.norms.LocalHeadsNorm`).

        sliding_window: the layer's attention window w (a query sees the keys at most ``w − 1`` positions back): an
            int, or the path of an attribute (``"self_attn.sliding_window"``, ``None`` on full-attention layers). Read
            under context parallelism only, where the block masks each ring block itself; on one cp rank the
            model's own masks carry the window.
        returns_attention_weights: the block returns ``(hidden_states, attention_weights)`` and its model reads
            ``outputs[0]`` (Falcon): the parallel block returns ``(hidden_states, None)``.

    Every parameter and buffer of the block must sit in a declared part: :func:`undeclared_parts` lists the
    others, and the policy refuses such a block.
    """

    attention_norm: Optional[str]
    mlp_norm: Optional[str]
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
    gate_up: Optional[str] = None
    qkv_per_head: bool = False
    qk_norm_over_heads: bool = False
    num_kv_heads: Union[int, str, None] = None
    head_dim: Union[int, str, None] = None
    attention_dropout: Union[float, str] = 0.0
    residual_dropouts: tuple[str, ...] = ()
    rotary: Union[str, Callable[..., Any], None] = None
    causal: bool = True
    attention: str = "eager"
    softmax_dtype: Optional[torch.dtype] = None
    scaling: Union[float, str, None] = None
    transposed: bool = False
    arguments: tuple[str, ...] = ()
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    norm_first: Union[bool, str] = True
    parallel_residual: bool = False
    attention_post_norm: Optional[str] = None
    mlp_post_norm: Optional[str] = None
    attention_softcap: Union[float, str, None] = None
    residual_multiplier: Union[float, str, None] = None
    returns_attention_weights: bool = False
    mlp_dropout: Optional[str] = None
    batch_first: Union[bool, str] = True
    sliding_window: Union[int, str, None] = None

    def projections(self) -> tuple[list[str], list[str]]:
        """The column-parallel paths of the attention input and of the MLP input."""
        attention = [self.qkv] if self.qkv else [p for p in (self.q, self.k, self.v) if p]
        mlp = [self.mlp_in] if self.mlp_in else [self.gate_up] if self.gate_up else [p for p in (self.gate, self.up) if p]
        return attention, mlp

    def paths(self) -> dict[str, str]:
        """Every submodule path the declaration names, by role."""
        attention, mlp = self.projections()
        named = {role: path for role, path in (("attention_norm", self.attention_norm), ("mlp_norm", self.mlp_norm),
                                               ("attention_out", self.attention_out), ("mlp_out", self.mlp_out)) if path}
        named.update({f"attention input {i}": p for i, p in enumerate(attention)})
        named.update({f"mlp input {i}": p for i, p in enumerate(mlp)})
        named.update({f"residual dropout {i}": p for i, p in enumerate(self.residual_dropouts)})
        named.update({role: p for role, p in (("q_norm", self.q_norm), ("k_norm", self.k_norm),
                                              ("mlp_dropout", self.mlp_dropout),
                                              ("attention_post_norm", self.attention_post_norm),
                                              ("mlp_post_norm", self.mlp_post_norm)) if p})
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


def rotary_function(block: nn.Module, spec: BlockSpec) -> Optional[Callable[..., Any]]:
    """The declared rotary function: as given, or found by name in ``block``'s own Python module (once, when the
    parallel block is built)."""
    if spec.rotary is None or callable(spec.rotary):
        return spec.rotary
    return getattr(sys.modules.get(type(block).__module__), spec.rotary, None)


def out_features(module: nn.Module) -> int:
    """Output features of an ``nn.Linear``, of a ``Conv1D`` (weight ``[in, out]``) or of an ``nn.MultiheadAttention``'s
    packed input projection (``3h``)."""
    if isinstance(module, nn.MultiheadAttention):
        return module.in_proj_weight.shape[0]
    module = linear_of(module)  # a PEFT LoRA layer: the projection it wraps
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]


def declared_modules(block: nn.Module, spec: BlockSpec) -> list[str]:
    """The paths of the submodules ``spec`` names in ``block`` (its projections, norms, activation and dropouts)."""
    paths = list(spec.paths().values())
    for extra in (spec.activation, spec.attention_dropout):
        if isinstance(extra, str) and not extra.startswith("F.") and isinstance(_maybe(block, extra), nn.Module):
            paths.append(extra)
    return paths


def undeclared_parts(block: nn.Module, spec: BlockSpec) -> list[str]:
    """The parameters and buffers of ``block`` that no part of ``spec`` holds: the parallel block would compute
    without them (a different function, silently) and they would leave the state dict."""
    declared = declared_modules(block, spec)

    def held(name: str) -> bool:
        return any(name.startswith(path + ".") for path in declared)

    parameters = [f"{n} (parameter {tuple(p.shape)})" for n, p in block.named_parameters() if not held(n)]
    buffers = [f"{n} (buffer {tuple(b.shape)})" for n, b in block.named_buffers() if not held(n)]
    return parameters + buffers


def _maybe(block: nn.Module, path: str) -> Any:
    try:
        return resolve(block, path)
    except AttributeError:
        return None
