"""The arguments a declared parallel block takes from the model that calls it: each understood by name, the rest
refused by name.

A block that accepts ``**kwargs`` and ignores them hides every change of its caller: transformers 5.24 renamed the
decoder layer's ``past_key_values`` to ``cache``, and a block that swallowed ``cache=`` attended without the cached
keys, silently. So every argument is either used (:class:`BlockArguments`), listed in :data:`NO_EFFECT` with the
reason it cannot change the block's output, or refused when it is not ``None``, before any communication.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from torch import Tensor

from lightning_seqpar.context_parallel.layout import LAYOUT_ARGUMENT

CACHE_NAMES = ("cache", "past_key_values", "layer_past")
"""Names of the key/value cache argument (transformers ≥ 5.24 passes ``cache``; earlier ``past_key_values``)."""

NO_EFFECT = {
    "use_cache": "the cache object itself is what the block reads (filled without gradients, lightning_seqpar."
                 "transformer.kv_cache)",
    "position_ids": "positions enter through position_embeddings, computed by the model from position_ids",
    "cache_position": "the positions' slots in a key/value cache, which the cache's own update places after those it "
                      "holds (transformers 5.x caches count them)",
    "output_attentions": "refused when true (the parallel block returns no attention probabilities)",
    "output_hidden_states": "hidden states are collected by the model, outside its layers",
    "num_items_in_batch": "a loss argument: the layers do not read it",
    "shift_labels": "a loss argument: the layers do not read it",
    "ignore_index": "a loss argument: the layers do not read it",
    "token_logps": "a loss argument (per-token log-probabilities, lightning_seqpar.hf.vocabulary.CausalLMLoss): the "
                   "layers do not read it",
    "token_entropy": "a loss argument (per-position entropies, lightning_seqpar.hf.vocabulary.CausalLMLoss): the "
                     "layers do not read it",
    "sum_per_row": "a loss argument (per-row log-probabilities, lightning_seqpar.hf.vocabulary.CausalLMLoss): the "
                   "layers do not read it",
    "sum_per_document": "a loss argument (per-document log-probabilities of packed rows, "
                        "lightning_seqpar.hf.vocabulary.CausalLMLoss): the layers do not read it",
    "encoder_hidden_states": "refused when given (cross-attention is not a declared part)",
    "encoder_attention_mask": "refused when given (cross-attention is not a declared part)",
    "output_router_logits": "the router logits are recorded by transformers' hooks on the router module, which the "
                            "parallel block calls; their load-balancing loss pools every rank's tokens "
                            "(lightning_seqpar.moe.balancing)",
    "alibi": "refused when given (ALiBi position biases are not a declared part; Falcon passes None with rotary "
             "embeddings)",
}
"""Arguments a caller may pass that do not change what the block computes, with the reason."""

_REFUSED_WHEN_SET = ("output_attentions", "encoder_hidden_states", "encoder_attention_mask", "alibi")
TORCH_MASKS = ("src_mask", "src_key_padding_mask", "is_causal")
"""torch's ``nn.TransformerEncoderLayer`` mask arguments (bool ``True`` = masked; see
:func:`~lightning_seqpar.transformer.masks.torch_attention_bias`)."""
USED = ("attention_mask", "position_embeddings", LAYOUT_ARGUMENT) + CACHE_NAMES + TORCH_MASKS


class BlockArguments(NamedTuple):
    """What a declared block uses of its call: the attention mask (``[b, 1, s, s]``, bool or additive), the rotary
    ``(cos, sin)`` of the whole sequence (``[b, s, d]`` each), the key/value cache object, torch's masks
    (``src_mask``, ``src_key_padding_mask``, ``is_causal``) by name when given, and the forward's context-parallel
    layout (:data:`~lightning_seqpar.context_parallel.layout.LAYOUT_ARGUMENT`; packed documents on one cp rank)."""

    attention_mask: Optional[Tensor]
    position_embeddings: Optional[tuple[Tensor, Tensor]]
    cache: Any
    torch_masks: dict[str, Any]
    layout: Any = None


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


def parse_block_arguments(block: str, positional_names: tuple[str, ...], args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> BlockArguments:
    """Name the positional ``args`` (after the hidden states) by ``positional_names`` and sort every argument into
    used, without effect, or refused.

    Raises:
        TypeError: a positional argument beyond the declared names, or a non-``None`` argument the block does not
            understand (or one of :data:`NO_EFFECT` set to a value that would change the result), naming the
            argument, the block and the fix.
    """
    if len(args) > len(positional_names):
        extra = len(positional_names) + 1
        raise TypeError(
            f"{block} was called with {len(args)} positional argument(s) after the hidden states; argument {extra} is "
            f"{_describe(args[len(positional_names)])}. The parallel block knows positional arguments "
            f"{list(positional_names) or 'none'}: declare the order the model passes them in "
            f"BlockSpec(arguments=(...)) with names among {sorted(USED + tuple(NO_EFFECT))}, or change the model to pass "
            f"them by keyword. An argument the block cannot use is not accepted, since ignoring it would compute "
            f"another function."
        )
    named = dict(zip(positional_names, args))
    for key, value in kwargs.items():
        if key in named and value is not None and named[key] is not None:
            raise TypeError(f"{block} got '{key}' both positionally and by keyword.")
        if value is not None or key not in named:
            named[key] = value
    for key, value in named.items():
        if value is None or key in USED:
            continue
        if key in _REFUSED_WHEN_SET and value is not False:
            raise TypeError(f"{block} was called with {key}={_describe(value)}: {NO_EFFECT[key]}. Call the model "
                            f"without it under tensor parallelism.")
        if key not in NO_EFFECT:
            raise TypeError(
                f"{block} was called with '{key}' ({_describe(value)}), which its tensor-parallel version does not "
                f"understand: it uses {list(USED)} and ignores only {sorted(NO_EFFECT)} (they do not change the "
                f"result). Leave '{key}' out of the call, or describe what it does in the block's Policy."
            )
    caches = [named[n] for n in CACHE_NAMES if named.get(n) is not None]
    torch_masks = {n: named[n] for n in TORCH_MASKS if named.get(n) is not None}
    return BlockArguments(named.get("attention_mask"), named.get("position_embeddings"), caches[0] if caches else None,
                          torch_masks, named.get(LAYOUT_ARGUMENT))
