"""Falcon's decoder layer (transformers' ``FalconDecoderLayer``), recognized by structure and declared from its config.

Three layouts of one fused ``query_key_value`` projection, all split over t ranks as
:class:`~lightning_seqpar.transformer.block_spec.BlockSpec` declares them:

- the new decoder architecture (Falcon-40B/180B, ``new_decoder_architecture``): rows grouped per key/value head, each
  group its ``a/a_kv`` query heads then its key and value head (``qkv_per_head``); a parallel residual from two norms
  (``ln_attn``, ``ln_mlp``) or one (``num_ln_in_parallel_attn=1``);
- the original with one key/value head per query head: ``[q_h; k_h; v_h]`` per head (GPT-NeoX's order);
- multi-query (Falcon-7B, ``multi_query``): ``[q; k; v]`` with one key/value head, so k and v are the smaller blocks;
  one key/value head cannot be split over t > 1 ranks, and the heads check refuses that with the valid sizes.

With ``parallel_attn`` attention and MLP read the same normed input. Falcon's layer returns
``(hidden_states, attention_weights)`` and its model reads ``outputs[0]``: the parallel block returns
``(hidden_states, None)``. Settings it does not implement are refused by name: ALiBi (``alibi=True``, Falcon-RW) and
the dropouts Falcon applies to the residual sums (``attention_dropout``, ``hidden_dropout`` > 0; 0 in Falcon's
published configs). transformers is never imported here.
"""

from __future__ import annotations

import torch.nn as nn

from lightning_seqpar._compat import hf_attention_implementation
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.tuner_layers import linear_of


def is_falcon_layout(module: nn.Module) -> bool:
    """Whether ``module`` is a Falcon decoder layer: ``self_attention`` with Linear ``query_key_value`` and ``dense``,
    ``mlp`` with Linear ``dense_h_to_4h`` / ``dense_4h_to_h`` and ``act``, of a config of ``model_type`` falcon."""
    attention, mlp = getattr(module, "self_attention", None), getattr(module, "mlp", None)
    config = getattr(attention, "config", None)
    return (getattr(config, "model_type", None) == "falcon"
            and all(isinstance(linear_of(getattr(attention, n, None)), nn.Linear) for n in ("query_key_value", "dense"))
            and all(isinstance(linear_of(getattr(mlp, n, None)), nn.Linear) for n in ("dense_h_to_4h", "dense_4h_to_h"))
            and hasattr(mlp, "act"))


def falcon_block_spec(module: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a Falcon decoder layer, read off its config (see the module docstring).

    Raises:
        ValueError: ``alibi=True``, or ``attention_dropout`` / ``hidden_dropout`` > 0, naming the setting and the fix.
    """
    config = module.self_attention.config
    if getattr(config, "alibi", False):
        raise ValueError("Falcon's alibi=True (ALiBi position biases, Falcon-RW) is not supported under tensor "
                         "parallelism: train a Falcon with rotary embeddings (alibi=False).")
    for option in ("attention_dropout", "hidden_dropout"):
        if float(getattr(config, option, 0.0) or 0.0) > 0.0:
            raise ValueError(f"Falcon's {option}={getattr(config, option)} is not supported under tensor parallelism "
                             f"(Falcon drops out the residual sum, which the parallel block does not implement): set "
                             f"it to 0.0, as Falcon's published configs do.")
    new = bool(config.new_decoder_architecture)
    heads = config.num_attention_heads
    kv_heads = config.num_kv_heads if new else 1 if config.multi_query else heads
    parallel = new or bool(config.parallel_attn)
    two_norms = isinstance(getattr(module, "ln_attn", None), nn.Module)
    return BlockSpec(
        attention_norm="ln_attn" if two_norms else "input_layernorm",
        mlp_norm="ln_mlp" if two_norms else "input_layernorm" if parallel else "post_attention_layernorm",
        parallel_residual=parallel, qkv="self_attention.query_key_value", qkv_per_head=new or not config.multi_query,
        attention_out="self_attention.dense", mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h",
        activation="mlp.act", num_heads=heads, num_kv_heads=kv_heads, head_dim=module.self_attention.head_dim,
        rotary="apply_rotary_pos_emb", attention=hf_attention_implementation(config), returns_attention_weights=True,
        layer_index="self_attention.layer_idx" if isinstance(getattr(module.self_attention, "layer_idx", None), int)
        else None,
    )
