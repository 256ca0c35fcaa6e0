"""Hugging Face decoder-only models of the Llama layout, recognized by structure, not by class name.

A block is of the Llama layout when it has ``self_attn`` with Linear ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, an ``mlp`` with Linear ``gate_proj``, ``up_proj``, ``down_proj`` and an ``act_fn``, and the norms
``input_layernorm`` and ``post_attention_layernorm``; and, where the model's config has a
``base_model_tp_plan``, that plan names q/k/v and gate/up column-wise and o/down row-wise. Llama, Mistral,
Qwen2 and others share it; a new model of the same layout needs no code change.

The policy is a :class:`~lightning_seqpar.rewrite.declared.DeclaredBlockPolicy` whose
:class:`~lightning_seqpar.transformer.declared_block.BlockSpec` is read off each block's config: sizes from
the config, rotary embeddings with the function of the block's own module (``apply_rotary_pos_emb``), the
attention kernel the config selects, the softmax in float32 as transformers' eager attention computes it.
transformers is never imported here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_seqpar._compat import hf_attention_implementation
from lightning_seqpar.rewrite.declared import DeclaredBlockPolicy
from lightning_seqpar.transformer.declared_block import BlockSpec

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
         "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _config(module: nn.Module) -> Optional[Any]:
    return getattr(getattr(module, "self_attn", None), "config", None)


def is_llama_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder layer of the Llama layout (see the module docstring)."""
    attention, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
    if attention is None or mlp is None or not hasattr(mlp, "act_fn") or _config(module) is None:
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


def llama_block_spec(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a Llama-layout decoder layer, read off its config."""
    config = _config(module)
    heads = config.num_attention_heads
    return BlockSpec(
        attention_norm="input_layernorm", mlp_norm="post_attention_layernorm",
        q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", attention_out="self_attn.o_proj",
        gate="mlp.gate_proj", up="mlp.up_proj", mlp_out="mlp.down_proj", activation="mlp.act_fn",
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(module.self_attn, "head_dim", None) or config.hidden_size // heads,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0), rotary="apply_rotary_pos_emb",
        attention=hf_attention_implementation(config), softmax_dtype=torch.float32,
        scaling=getattr(module.self_attn, "scaling", None),
    )


class LlamaLayoutPolicy(DeclaredBlockPolicy):
    """Any Hugging Face decoder layer of the Llama layout → :class:`ParallelBlock`."""

    def __init__(self) -> None:
        super().__init__(nn.Module)  # matched by structure (:meth:`matches`), not by class

    def matches(self, module: nn.Module) -> bool:
        return is_llama_layout(module)

    def spec_for(self, module: nn.Module) -> BlockSpec:
        return llama_block_spec(module)

    def layout_name(self) -> str:
        return " (Llama layout)"
