"""Hugging Face decoder-only models of the Llama layout, recognized by structure, not by class name.

A block is of the Llama layout when it has ``self_attn`` with Linear ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, an ``mlp`` with Linear ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn``, and the norm
``input_layernorm`` (then ``post_attention_layernorm`` before the MLP; or, Gemma 2/3, after attention, with
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP; or none, Cohere: attention and MLP
read the same normed input, a parallel residual); and, where the model's config has a ``base_model_tp_plan``, that
plan names q/k/v and gate/up column-wise and o/down row-wise. Llama, Mistral, Qwen2, Gemma 2/3, Cohere and others
share it; a new model of the same layout needs no code change.

The policy is a :class:`~lightning_seqpar.DeclaredBlockPolicy` whose
:class:`~lightning_seqpar.transformer.declared_block.BlockSpec` is read off each block's config: sizes from
the config, rotary embeddings with the function of the block's own module (``apply_rotary_pos_emb``), the
attention kernel the config selects, the softmax in float32 as transformers' eager attention computes it.
transformers is never imported here.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from lightning_seqpar._compat import hf_attention_implementation
from lightning_seqpar.hf.falcon import falcon_block_spec, is_falcon_layout
from lightning_seqpar.hf.model_check import eager_experts
from lightning_seqpar.hf.moe_loss import install_parallel_load_balancing
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.mlp_part import DenseMLPSpec
from lightning_seqpar.transformer.moe_part import MoESpec
from lightning_seqpar.rewriting.declared_policy import DeclaredBlockPolicy
from lightning_seqpar.transformer.tuner_layers import linear_of

_SAMPLE_HEAD_DIM = 8
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# MLPs of the Llama family: (gate, input, output, activation); gate None for a plain MLP, down(act(in(x))).
_MLPS = (("gate_proj", "up_proj", "down_proj", "act_fn"),   # SwiGLU (Llama, Qwen, Gemma ...)
         (None, "up_proj", "down_proj", "act_fn"),           # Arcee, Nemotron
         (None, "c_fc", "c_proj", "act"),                    # Starcoder2
         (None, "fc1", "fc2", "activation_fn"),              # Phi
         ("gate_up_proj", None, "down_proj", "activation_fn"),  # fused [gate; up]: Phi-3
         ("gate_up_proj", None, "down_proj", "act_fn"))      # GLM


def mlp_parts(mlp: Optional[nn.Module]) -> Optional[tuple[Optional[str], str, str, str]]:
    """The names ``(gate, input, output, activation)`` of a Llama-family MLP (see :data:`_MLPS`; input ``None``: the
    gate is the fused ``[gate; up]``), or ``None``."""
    for gate, up, down, act in _MLPS:
        linears = [n for n in (gate, up, down) if n]
        if all(isinstance(linear_of(getattr(mlp, n, None)), nn.Linear) for n in linears) and hasattr(mlp, act) and (
                gate is not None or not hasattr(mlp, "gate_proj")):
            return gate, up, down, act
    return None


def moe_parts(mlp: Optional[nn.Module]) -> Optional[dict[str, Any]]:
    """The names of a transformers 5.x mixture of experts (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GLM-4.5, gpt-oss):
    ``router`` (``gate``, or gpt-oss's ``router``; ``weight`` ``[E, h]``), ``experts`` (packed ``gate_up_proj`` /
    ``down_proj``, optionally with both biases, and ``act_fn`` or a gating function ``_apply_gate`` of their own),
    ``transposed`` (the experts' ``is_transposed``) and, where the family has one, a shared expert (``shared_expert``
    or ``shared_experts``, a Llama-family MLP) and its gate (``shared_expert_gate``); ``None`` when ``mlp`` is not one.
    """
    name = next((n for n in ("gate", "router") if isinstance(getattr(mlp, n, None), nn.Module)), None)
    router, experts = getattr(mlp, name, None) if name else None, linear_of(getattr(mlp, "experts", None))
    weight = getattr(router, "weight", None)
    if not isinstance(router, nn.Module) or isinstance(router, nn.Linear) or not isinstance(experts, nn.Module):
        return None
    packed = {n: getattr(experts, n, None) for n in ("gate_up_proj", "down_proj")}
    if weight is None or weight.dim() != 2 or not all(isinstance(w, nn.Parameter) and w.dim() == 3
                                                       for w in packed.values()):
        return None
    glu = _own_gate(experts)
    if glu is None and not hasattr(experts, "act_fn"):
        return None
    shared = next((n for n in ("shared_expert", "shared_experts") if isinstance(getattr(mlp, n, None), nn.Module)), None)
    if shared is not None and mlp_parts(getattr(mlp, shared)) is None:
        return None
    gate = "shared_expert_gate" if isinstance(linear_of(getattr(mlp, "shared_expert_gate", None)), nn.Linear) else None
    return {"router": name, "experts": "experts", "shared": shared, "shared_gate": gate, "glu": glu,
            "transposed": bool(getattr(experts, "is_transposed", False))}


def _own_gate(experts: nn.Module) -> Optional[str]:
    """``"_apply_gate"`` where the experts' class gates with a function of its own (gpt-oss: interleaved, clamped),
    not transformers' default ``act_fn(gate) · up`` over the two halves."""
    function = getattr(type(experts), "_apply_gate", None)
    return "_apply_gate" if function is not None and function.__name__ != "_default_apply_gate" else None


def mlp_name(module: nn.Module) -> str:
    """The decoder layer's MLP attribute: ``mlp``, or ``block_sparse_moe`` (GraniteMoE)."""
    return "block_sparse_moe" if isinstance(getattr(module, "block_sparse_moe", None), nn.Module) and not hasattr(
        module, "mlp") else "mlp"


def freeze_routers(model: nn.Module) -> list[str]:
    """Freeze the router of every mixture of experts in ``model`` (``requires_grad=False``: no gradient, no optimizer
    state; the experts still learn from the routing it gives); the routers' paths."""
    frozen = []
    for name, module in model.named_modules():
        mlp = getattr(module, mlp_name(module), None)
        parts = moe_parts(mlp)
        if parts is not None:
            getattr(mlp, parts["router"]).requires_grad_(False)
            path = f"{mlp_name(module)}.{parts['router']}"
            frozen.append(f"{name}.{path}" if name else path)
    return frozen


def _moe_spec(mlp: nn.Module, name: str, mlp_norm: Optional[str], mlp_post_norm: Optional[str]) -> MoESpec:
    names = moe_parts(mlp)
    shared = None
    if names["shared"]:
        gate, up, down, act = mlp_parts(getattr(mlp, names["shared"]))
        prefix = f"{name}.{names['shared']}"
        shared = DenseMLPSpec(mlp_norm=None, mlp_out=f"{prefix}.{down}", activation=f"{prefix}.{act}",
                              gate=f"{prefix}.{gate}" if gate and up else None,
                              up=f"{prefix}.{up}" if gate and up else None,
                              gate_up=f"{prefix}.{gate}" if gate and not up else None,
                              mlp_in=None if gate else f"{prefix}.{up}")
    glu = f"{name}.experts.{names['glu']}" if names["glu"] else None
    return MoESpec(mlp_norm=mlp_norm, router=f"{name}.{names['router']}", experts=f"{name}.experts",
                   activation=None if glu else f"{name}.experts.act_fn", glu=glu, transposed=names["transposed"],
                   shared=shared, shared_gate=f"{name}.{names['shared_gate']}" if names["shared_gate"] else None,
                   mlp_post_norm=mlp_post_norm)


def _fused_qkv(attention: nn.Module) -> bool:
    """A fused ``qkv_proj``, ``[q; k; v]`` (Phi-3; under grouped-query attention k and v are the smaller parts:
    Phi-3-medium, Phi-4-mini)."""
    config = getattr(attention, "config", None)
    return isinstance(linear_of(getattr(attention, "qkv_proj", None)), nn.Linear) and \
        getattr(config, "num_attention_heads", None) is not None


def attention_output(attention: Optional[nn.Module]) -> Optional[str]:
    """The attention output projection's name: ``o_proj`` (Llama), ``dense`` (Phi)."""
    return next((n for n in ("o_proj", "dense") if isinstance(linear_of(getattr(attention, n, None)), nn.Linear)), None)
_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
         "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _config(module: nn.Module) -> Optional[Any]:
    attention = getattr(module, "self_attn", None) or getattr(module, "attn", None)  # Llama / GPT-2 naming
    return getattr(attention, "config", None)


def is_llama_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder layer of the Llama layout (see the module docstring)."""
    attention, mlp = getattr(module, "self_attn", None), getattr(module, mlp_name(module), None)
    if attention is None or mlp is None or getattr(attention, "config", None) is None:
        return False
    if not (all(isinstance(linear_of(getattr(attention, n, None)), nn.Linear) for n in _ATTENTION[:3]) or _fused_qkv(attention)):
        return False
    if attention_output(attention) is None or (mlp_parts(mlp) is None and moe_parts(mlp) is None):
        return False
    if not (isinstance(getattr(module, "input_layernorm", None), nn.Module) or _post_norms_only(module)):
        return False
    plan = getattr(_config(module), "base_model_tp_plan", None) or {}
    for suffix, style in _PLAN.items():  # the model's own plan, where it has one, must agree
        styles = {v for k, v in plan.items() if k.endswith(suffix)}
        if styles and not any(s.startswith(style) for s in styles):
            return False
    return True


_FUSED_ATTENTION = ("qkv_proj", "query_key_value", "Wqkv", "c_attn", "qkv")
_ATTENTION_NAMES = ("self_attn", "attention", "self_attention", "attn")


def _children(module: Optional[nn.Module]) -> list[str]:
    return [n for n, _ in module.named_children()] if isinstance(module, nn.Module) else []


def llama_layout_mismatch(module: nn.Module) -> list[str]:
    """Why ``module`` is not a decoder layer of the Llama layout, in the field's words (``"fused query_key_value"``,
    ``"extra norms around the MLP"``, ``"mixture of experts"``); empty when it is, or when it is no decoder layer at
    all."""
    attention = next((getattr(module, n) for n in _ATTENTION_NAMES if isinstance(getattr(module, n, None), nn.Module)),
                     None)
    if attention is None:
        return []
    reasons = []
    fused = [n for n in _FUSED_ATTENTION if hasattr(attention, n)]
    if fused and not (fused[0] == "qkv_proj" and _fused_qkv(attention)):
        reasons.append(f"fused {fused[0]} (q, k and v in one projection)")
    elif not fused and not all(isinstance(linear_of(getattr(attention, n, None)), nn.Linear) for n in _ATTENTION[:3]):
        reasons.append(f"attention projections {_children(attention)} (not q_proj/k_proj/v_proj)")
    if (not fused or _fused_qkv(attention)) and attention_output(attention) is None:
        reasons.append(f"attention output not o_proj/dense (attention has {_children(attention)})")
    mlp = next((getattr(module, n) for n in ("mlp", "feed_forward", "block_sparse_moe") if hasattr(module, n)), None)
    if moe_parts(mlp) is not None:
        if float(getattr(mlp, "jitter_noise", 0.0) or 0.0) > 0:
            reasons.append(f"router jitter noise (router_jitter_noise={mlp.jitter_noise}; train with 0)")
    elif any(n in _children(mlp) for n in ("experts", "router")) or hasattr(module, "block_sparse_moe"):
        reasons.append(f"mixture of experts of {_children(mlp)} (not a router module `gate` or `router` with packed "
                       f"`experts` gate_up_proj/down_proj as transformers 5.x builds them; a router that is an "
                       f"nn.Linear, as PhiMoE's sampling router, is not one)")
    elif mlp is not None and mlp_parts(mlp) is None:
        reasons.append(f"MLP of {_children(mlp)} (not gate_proj/up_proj/down_proj, up_proj/down_proj, c_fc/c_proj or "
                       f"fc1/fc2)")
    has = {n for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm") if isinstance(getattr(module, n, None), nn.Module)}
    if "input_layernorm" not in has and "post_feedforward_layernorm" in has and not _post_norms_only(module):
        reasons.append("post-norms other than OLMo 2's (post_attention_layernorm and post_feedforward_layernorm, none "
                       "before)")
    elif len({"pre_feedforward_layernorm", "post_feedforward_layernorm"} & has) == 1 and not _post_norms_only(module):
        reasons.append("extra norms around the MLP (pre/post_feedforward_layernorm)")
    return reasons


_HALF_WIDTH_ROTARY = frozenset({"gpt_oss"})
"""Families whose rotary embedding gives cos/sin of ``d/2`` columns and turns the whole head (not partial rotary)."""

_SOFTMAX_IN_INPUT_DTYPE = frozenset({"gpt_oss"})
"""Families whose eager attention computes the softmax in the scores' dtype (with its sink column), not float32."""

_ROTARY_ON_SLIDING_LAYERS_ONLY = frozenset({"cohere2"})
"""Families whose attention applies rotary embeddings on its sliding-window layers only (global layers are NoPE)."""


def _uses_rope(module: nn.Module) -> bool:
    """Whether the layer's attention applies rotary embeddings: not SmolLM3's NoPE layers (``use_rope``), nor Cohere 2's
    global layers."""
    attention = module.self_attn
    if not getattr(attention, "use_rope", True):
        return False
    model_type = getattr(getattr(attention, "config", None), "model_type", None)
    return not (model_type in _ROTARY_ON_SLIDING_LAYERS_ONLY and getattr(attention, "sliding_window", None) is None)


def _sliding_window(attention: nn.Module, config: Any) -> Union[int, str, None]:
    """The layer's attention window: the attention's own ``sliding_window`` where it has one (per layer type: Qwen2,
    Gemma 2/3, Cohere 2), else the config's, which the attention passes to its kernel on every layer (Mistral, Phi-3,
    Starcoder2). Read under context parallelism, where the block masks by it (the model's masks are not used)."""
    if hasattr(attention, "sliding_window"):
        return "self_attn.sliding_window"
    window = getattr(config, "sliding_window", None)
    return int(window) if window is not None else None


def _post_norms_only(module: nn.Module) -> bool:
    """OLMo 2's norms: ``post_attention_layernorm`` after attention and ``post_feedforward_layernorm`` after the MLP,
    none before either."""
    return (not isinstance(getattr(module, "input_layernorm", None), nn.Module)
            and all(isinstance(getattr(module, n, None), nn.Module)
                    for n in ("post_attention_layernorm", "post_feedforward_layernorm")))


def _qk_norm_over_heads(module: nn.Module) -> bool:
    """q/k norms over the whole projection (all heads: OLMo 2) rather than over each head (Qwen3)."""
    attention = module.self_attn
    weight = getattr(getattr(attention, "q_norm", None), "weight", None)
    heads = attention.config.num_attention_heads
    head_dim = getattr(attention, "head_dim", None) or attention.config.hidden_size // heads
    return weight is not None and weight.dim() == 1 and weight.shape[0] == heads * head_dim


def _head_norm(attention: nn.Module, which: str) -> Optional[str]:
    """The path of the q or k norm: ``q_norm`` (Qwen3, Gemma 3, OLMo 2, Cohere) or ``q_layernorm`` (StableLM)."""
    name = next((n for n in (f"{which}_norm", f"{which}_layernorm") if isinstance(getattr(attention, n, None), nn.Module)),
                None)
    return f"self_attn.{name}" if name else None


def _layer_index(attention: nn.Module, path: str) -> Optional[str]:
    """The path of the attention's slot in a key/value cache (transformers' ``layer_idx``), where it has one."""
    return f"{path}.layer_idx" if isinstance(getattr(attention, "layer_idx", None), int) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sandwich(module: nn.Module) -> bool:
    """Gemma 2/3's norms: ``post_attention_layernorm`` after attention, ``pre_feedforward_layernorm`` before the MLP and
    ``post_feedforward_layernorm`` after it."""
    return all(isinstance(getattr(module, n, None), nn.Module)
               for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))


def llama_block_spec(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a Llama-layout decoder layer, read off its config (Gemma 2/3: norms around both
    branches, attention-logit soft-capping)."""
    config = module.self_attn.config
    heads = config.num_attention_heads
    sandwich, post_only = _sandwich(module), _post_norms_only(module)
    name = mlp_name(module)
    moe = moe_parts(getattr(module, name)) is not None
    gate, up, down, act = (None, None, None, None) if moe else mlp_parts(module.mlp)
    fused_qkv = _fused_qkv(module.self_attn) and not isinstance(linear_of(getattr(module.self_attn, "q_proj", None)), nn.Linear)
    parallel = not isinstance(getattr(module, "post_attention_layernorm", None), nn.Module)  # Cohere: one norm
    mlp_norm = (None if post_only else "input_layernorm" if parallel else "pre_feedforward_layernorm" if sandwich
                else "post_attention_layernorm")
    mlp_post_norm = "post_feedforward_layernorm" if sandwich or post_only else None
    if moe:
        mlp = {"mlp": _moe_spec(getattr(module, name), name, mlp_norm, mlp_post_norm)}
    else:
        mlp = dict(mlp_norm=mlp_norm, mlp_post_norm=mlp_post_norm,
                   gate=f"mlp.{gate}" if gate and up else None, up=f"mlp.{up}" if gate and up else None,
                   gate_up=f"mlp.{gate}" if gate and not up else None, mlp_in=None if gate else f"mlp.{up}",
                   mlp_out=f"mlp.{down}", activation=f"mlp.{act}")
    return BlockSpec(
        attention_norm=None if post_only else "input_layernorm", parallel_residual=parallel,
        attention_post_norm="post_attention_layernorm" if sandwich or post_only else None, **mlp,
        qk_norm_over_heads=_qk_norm_over_heads(module),
        attention_softcap=getattr(module.self_attn, "attn_logit_softcapping", None),
        residual_multiplier="residual_multiplier" if _number(getattr(module, "residual_multiplier", None))
        else None,  # Granite
        q=None if fused_qkv else "self_attn.q_proj", k=None if fused_qkv else "self_attn.k_proj",
        v=None if fused_qkv else "self_attn.v_proj", qkv="self_attn.qkv_proj" if fused_qkv else None,
        attention_out=f"self_attn.{attention_output(module.self_attn)}",
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(module.self_attn, "head_dim", None) or config.hidden_size // heads,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0), rotary="apply_rotary_pos_emb" if _uses_rope(module) else None,
        attention=hf_attention_implementation(config),
        softmax_dtype=None if getattr(config, "model_type", None) in _SOFTMAX_IN_INPUT_DTYPE else torch.float32,
        scaling=getattr(module.self_attn, "scaling", None),
        q_norm=_head_norm(module.self_attn, "q"), k_norm=_head_norm(module.self_attn, "k"),
        sliding_window=_sliding_window(module.self_attn, config),
        rotary_dims=(getattr(module.self_attn, "head_dim", None) or config.hidden_size // heads)
        if getattr(config, "model_type", None) in _HALF_WIDTH_ROTARY else None,
        sinks="self_attn.sinks" if isinstance(getattr(module.self_attn, "sinks", None), nn.Parameter) else None,
        layer_index=_layer_index(module.self_attn, "self_attn"),
    )


def is_gpt2_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder block of GPT-2's layout: ``ln_1``, ``attn`` with fused ``c_attn`` and
    ``c_proj`` Conv1D (weights ``[in, out]``), ``ln_2``, ``mlp`` with ``c_fc``/``c_proj`` Conv1D and ``act``; no
    cross-attention."""
    attention, mlp = getattr(module, "attn", None), getattr(module, "mlp", None)
    if attention is None or mlp is None or getattr(attention, "config", None) is None or hasattr(module, "crossattention"):
        return False
    conv = [linear_of(c) for c in (getattr(attention, "c_attn", None), getattr(attention, "c_proj", None),
                                   getattr(mlp, "c_fc", None), getattr(mlp, "c_proj", None))]
    if not all(c is not None and hasattr(c, "nf") and getattr(c, "weight", None) is not None for c in conv):
        return False
    return all(isinstance(getattr(module, n, None), nn.Module) for n in ("ln_1", "ln_2")) and hasattr(mlp, "act")


def gpt2_block_spec(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a GPT-2-layout block, read off its config.

    Raises:
        ValueError: ``scale_attn_by_inverse_layer_idx`` or ``reorder_and_upcast_attn`` (not supported).
    """
    config = module.attn.config
    for option in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(config, option, False):
            raise ValueError(f"GPT-2's {option}=True is not supported under tensor parallelism; set it to False.")
    return BlockSpec(
        attention_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn", attention_out="attn.c_proj", mlp_in="mlp.c_fc",
        mlp_out="mlp.c_proj", activation="mlp.act", num_heads=config.num_attention_heads,
        attention_dropout=float(config.attn_pdrop), residual_dropouts=("attn.resid_dropout", "mlp.dropout"),
        attention=hf_attention_implementation(config), transposed=True,
        arguments=("cache", "attention_mask", "encoder_hidden_states"),
        scaling=None if getattr(config, "scale_attn_weights", True) else 1.0,
        layer_index=_layer_index(module.attn, "attn"),
    )


class HFLayoutPolicy(DeclaredBlockPolicy):
    """Every Hugging Face block of one layout → :class:`ParallelBlock`, recognized by ``is_layout`` (structure, not
    class) and declared by ``block_spec`` (read off the block's config).

    Sliding-window layers (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, ``layer_types``) are exact
    as they are: transformers builds each layer type's mask once per forward, the window in it, and the parallel
    block applies the mask it is given (``torch.where`` on the scores, or the fused kernel's ``attn_mask``); where
    the window covers the whole sequence transformers passes no mask and the block is causal."""

    def __init__(self, layout: str, is_layout: Callable[[nn.Module], bool],
                 block_spec: Callable[[nn.Module], BlockSpec],
                 why_not: Optional[Callable[[nn.Module], list[str]]] = None) -> None:
        super().__init__(nn.Module)  # matched by structure (:meth:`matches`), not by class
        self.layout, self.is_layout, self.block_spec, self.why_not = layout, is_layout, block_spec, why_not

    def check(self, module: nn.Module, ctx: Any, name: str) -> None:
        unsupported = self.mismatch(module)
        if unsupported:
            raise ValueError(f"{name} ({type(module).__name__}): the {self.layout} layout's parallel block does not "
                             f"implement {'; '.join(unsupported)}. Train with the default setting, or write a Policy "
                             f"for this block.")
        super().check(module, ctx, name)

    def rewrite(self, module: nn.Module, ctx: Any, *, enter_region: bool, exit_region: bool) -> nn.Module:
        if moe_parts(getattr(module, mlp_name(module), None)) is not None:  # its load-balancing loss over every rank
            install_parallel_load_balancing(module)
        return super().rewrite(module, ctx, enter_region=enter_region, exit_region=exit_region)

    def mismatch(self, module: nn.Module) -> list[str]:
        return self.why_not(module) if self.why_not is not None else []

    def matches(self, module: nn.Module) -> bool:
        return self.is_layout(module)

    def spec_for(self, module: nn.Module) -> BlockSpec:
        return self.block_spec(module)

    def layout_name(self) -> str:
        return f" ({self.layout} layout)"

    def undeclared_message(self, module: nn.Module, name: str, left_out: list[str]) -> str:
        return (f"{name} ({type(module).__name__}): this Hugging Face block has parts the {self.layout} layout does not "
                f"have: {', '.join(left_out)}. Its parallel version would compute without them, so "
                f"{type(module).__name__} is not supported (the families tested: the README's family table). "
                f"Describe the block with a BlockSpec that names them, or write a Policy for it.")

    def sample_block(self, module: nn.Module) -> nn.Module:
        """A small block of ``module``'s class built from a copy of its config with 8 values per head (the head
        counts, and so the split over tp, unchanged), so that the self-check costs little whatever the model's
        size, and works for a model on the meta device."""
        config = eager_experts(copy.deepcopy(_config(module)))  # the self-check runs in float64
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        hidden = heads * _SAMPLE_HEAD_DIM
        for key, value in (("hidden_size", hidden), ("head_dim", _SAMPLE_HEAD_DIM), ("intermediate_size", 4 * hidden),
                           ("n_embd", hidden), ("n_inner", None), ("moe_intermediate_size", 8),
                           ("shared_expert_intermediate_size", 8)):
            if hasattr(config, key):
                setattr(config, key, value)
        attention = getattr(module, "self_attn", None) or getattr(module, "attn", None)
        with torch.device("cpu"):
            small = type(module)(config, getattr(attention, "layer_idx", 0) or 0)
        return super().sample_block(small)


def is_neox_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a GPT-NeoX layer: ``attention`` with a per-head fused ``query_key_value`` and ``dense``,
    ``mlp`` with ``dense_h_to_4h`` / ``dense_4h_to_h`` / ``act``, ``input_layernorm``, ``post_attention_layernorm``
    and the two residual dropouts."""
    attention, mlp = getattr(module, "attention", None), getattr(module, "mlp", None)
    config = getattr(attention, "config", None)
    return (getattr(config, "model_type", None) == "gpt_neox"
            and all(isinstance(linear_of(getattr(attention, n, None)), nn.Linear) for n in ("query_key_value", "dense"))
            and all(isinstance(linear_of(getattr(mlp, n, None)), nn.Linear) for n in ("dense_h_to_4h", "dense_4h_to_h"))
            and hasattr(mlp, "act")
            and all(isinstance(getattr(module, n, None), nn.Module)
                    for n in ("input_layernorm", "post_attention_layernorm", "post_attention_dropout",
                              "post_mlp_dropout")))


def neox_block_spec(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a GPT-NeoX layer (Pythia): per-head fused q/k/v, partial rotary, the parallel
    residual of two norms when ``use_parallel_residual``."""
    config = module.attention.config
    return BlockSpec(
        attention_norm="input_layernorm", mlp_norm="post_attention_layernorm",
        parallel_residual=bool(config.use_parallel_residual), qkv="attention.query_key_value", qkv_per_head=True,
        attention_out="attention.dense", mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h", activation="mlp.act",
        num_heads=config.num_attention_heads, head_dim=module.attention.head_size,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        residual_dropouts=("post_attention_dropout", "post_mlp_dropout"), rotary="apply_rotary_pos_emb",
        attention=hf_attention_implementation(config), softmax_dtype=torch.float32,
        scaling=getattr(module.attention, "scaling", None), layer_index=_layer_index(module.attention, "attention"),
    )


def hf_policies() -> list[HFLayoutPolicy]:
    """The built-in Hugging Face layouts: Llama (Mistral, Qwen2, ...), GPT-2, GPT-NeoX and Falcon."""
    return [HFLayoutPolicy("Llama", is_llama_layout, llama_block_spec, llama_layout_mismatch),
            HFLayoutPolicy("GPT-2", is_gpt2_layout, gpt2_block_spec),
            HFLayoutPolicy("GPT-NeoX", is_neox_layout, neox_block_spec),
            HFLayoutPolicy("Falcon", is_falcon_layout, falcon_block_spec)]
