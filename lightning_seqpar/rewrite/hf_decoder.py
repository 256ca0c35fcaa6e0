"""Hugging Face decoder-only models of the Llama layout, recognized by structure, not by class name.

A block is of the Llama layout when it has ``self_attn`` with Linear ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, an ``mlp`` with Linear ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn``, and the norms
``input_layernorm`` and ``post_attention_layernorm``; and, where the model's config has a
``base_model_tp_plan``, that plan names q/k/v and gate/up column-wise and o/down row-wise. Llama, Mistral,
Qwen2 and others share it; a new model of the same layout needs no code change. Sizes come from the
attention module's ``config``; rotary embeddings are applied with the function of the block's own module
(``apply_rotary_pos_emb``), so a family's variant of it is honoured. transformers is never imported here.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch.nn as nn

from lightning_seqpar._compat import hf_attention_implementation
from lightning_seqpar.rewrite.policy import Policy, require_divisible
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.llama import ATTENTION_IMPLEMENTATIONS, ParallelLlamaDecoderLayer

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
         "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _config(module: nn.Module) -> Optional[Any]:
    return getattr(getattr(module, "self_attn", None), "config", None)


def is_llama_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder layer of the Llama layout (see the module docstring)."""
    attention, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
    if attention is None or mlp is None or not hasattr(mlp, "act_fn"):
        return False
    if not all(isinstance(getattr(attention, n, None), nn.Linear) for n in _ATTENTION):
        return False
    if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP):
        return False
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in ("input_layernorm", "post_attention_layernorm")):
        return False
    plan = getattr(_config(module), "base_model_tp_plan", None) or {}
    for suffix, style in _PLAN.items():  # the model's own plan, where it has one, must agree
        styles = {v for k, v in plan.items() if k.endswith(suffix)}
        if styles and not any(s.startswith(style) for s in styles):
            return False
    return True


def _sizes(module: nn.Module) -> tuple[int, int, int]:
    config = _config(module)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module.self_attn, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


class LlamaLayoutPolicy(Policy):
    """Any Hugging Face decoder layer of the Llama layout → :class:`ParallelLlamaDecoderLayer`."""

    block = nn.Module  # matched by structure (:meth:`matches`), not by class
    role = "layer"

    def matches(self, module: nn.Module) -> bool:
        return is_llama_layout(module)

    def check(self, module, ctx, name):
        heads, kv_heads, _ = _sizes(module)
        require_divisible(name, "num_attention_heads", heads, ctx.tp)
        if kv_heads % ctx.tp:
            valid = [t for t in range(1, kv_heads + 1) if kv_heads % t == 0 and heads % t == 0]
            raise ValueError(
                f"{name}: num_key_value_heads = {kv_heads} is not divisible by the tensor-parallel size tp = {ctx.tp} "
                f"(grouped-query attention splits the key/value heads over tp ranks). Valid tp: {valid}."
            )
        require_divisible(name, "intermediate_size", module.mlp.gate_proj.out_features, ctx.tp)
        implementation = hf_attention_implementation(_config(module))
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"{name}: attn_implementation={implementation!r} is not supported under tensor parallelism. Build the "
                f"model with attn_implementation='eager' (explicit core attention: selective recomputation applies) "
                f"or 'sdpa' (fused: keeps no s² tensor)."
            )
        if not callable(getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)):
            raise ValueError(f"{name}: {type(module).__name__}'s module has no apply_rotary_pos_emb; it is not of "
                             f"the Llama layout. Describe the block to lightning_seqpar with a policy of your own.")

    def describe(self, module, ctx):
        heads, kv_heads, head_dim = _sizes(module)
        ffn = module.mlp.gate_proj.out_features
        implementation = hf_attention_implementation(_config(module))
        return (
            f"{type(module).__name__} (Llama layout): {heads} query / {kv_heads} key-value heads → "
            f"{heads // ctx.tp} / {kv_heads // ctx.tp} per rank (q/k/v column-parallel, one gather; o_proj row-parallel); "
            f"gate/up {module.mlp.gate_proj.in_features}→{ffn} column-parallel, down row-parallel; "
            f"input/post_attention RMSNorm {'sequence-parallel' if ctx.sp else 'replicated'}; "
            f"attention {implementation}"
            + (" (fused kernel: no s² tensor, selective recompute unnecessary)" if implementation == "sdpa" else "")
        )

    def rewrite(self, module, ctx, *, enter_region, exit_region):
        heads, kv_heads, head_dim = _sizes(module)
        rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
        return ParallelLlamaDecoderLayer(module, ctx, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                         implementation=hf_attention_implementation(_config(module)), rotary=rotary,
                                         enter_region=enter_region, exit_region=exit_region)
