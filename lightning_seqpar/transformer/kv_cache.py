"""A rewritten layer's key/value cache: each rank keeps its own heads, in the caller's cache object.

A parallel block called without gradients and with a key/value cache (transformers' ``Cache``: ``DynamicCache``,
``StaticCache``, their sliding-window layers) stores this rank's keys and values, ``[b, a_kv/t, s, d]`` per layer,
through the cache's own ``update(k, v, layer_index)``, and attends over what it returns: the cached past and the new
positions. Transformers' ``generate`` and :func:`lightning_seqpar.generate` drive it alike; the cache's bytes on a rank
are ``2·b·(a_kv/t)·s·d`` bytes-per-element per layer (:func:`~lightning_seqpar.memory.kv_cache.kv_cache_bytes`).

Sequence parallelism splits a forward's positions over the t ranks, which one decoded position cannot be: a forward
whose new positions do not divide by t (a decode step, or a prompt of such a length) runs with sequence parallelism
suspended (:func:`suspended_sequence_parallel`): the column-parallel projections take the whole ``[s, b, h]`` and the
row-parallel ones all-reduce, two collectives per layer as tensor parallelism without SP (Megatron-Core's inference
turns SP off for decoding too). The block entering the parallel region decides, and marks the cache with it, so every
block of the forward reads the same answer.

With gradients the cache is neither filled nor read: a training forward given transformers' default empty cache
computes as without one (a recomputed layer would otherwise append its keys twice), and one holding past tokens is
refused (:func:`refuse_training_cache`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

STEP_MARK = "lightning_seqpar_sequence_parallel"
"""Attribute set on a cache object by the block entering the parallel region: whether this forward runs with
sequence parallelism (read by the blocks after it)."""


def uses_cache(cache: Any) -> bool:
    """Whether a block fills and reads ``cache`` in this forward: one is given and no gradient is taken."""
    return cache is not None and not torch.is_grad_enabled()


def step_sequence_parallel(cache: Any, enters_region: bool, positions: int, sequence_parallel: bool, t: int) -> bool:
    """Whether this cached forward splits its positions over the t ranks: decided by the block entering the parallel
    region (``positions``: the forward's new positions, as that block sees them) and marked on the cache; read back by
    the blocks after it."""
    if enters_region:
        decided = sequence_parallel and t > 1 and positions % t == 0
        setattr(cache, STEP_MARK, decided)
        return decided
    return bool(getattr(cache, STEP_MARK, sequence_parallel))


@contextlib.contextmanager
def suspended_sequence_parallel(block: nn.Module, parts: tuple[Any, ...]) -> Iterator[None]:
    """Within it, ``block``'s projections (every submodule with a ``sequence_parallel`` flag: column- and row-parallel
    linears, their adapters' bases) and its ``parts`` (objects with an ``sp`` flag) run as without sequence
    parallelism; the flags are restored on exit, error or not. Only eval-mode forwards without gradients enter it, so
    no backward ever reads a flag that changed under it."""
    flagged = [(m, "sequence_parallel") for m in block.modules() if isinstance(getattr(m, "sequence_parallel", None),
                                                                                bool)]
    flagged += [(p, "sp") for p in (block, *parts) if isinstance(getattr(p, "sp", None), bool)]
    saved = [(owner, name, getattr(owner, name)) for owner, name in flagged]
    try:
        for owner, name in flagged:
            setattr(owner, name, False)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def cached_keys_values(cache: Any, k: Tensor, v: Tensor, layer_index: Optional[int], name: str
                       ) -> tuple[Tensor, Tensor]:
    """This rank's keys and values ``[b, a_kv/t, s_new, d]`` stored in ``cache`` at ``layer_index``; returns what the
    cache gives back: ``[b, a_kv/t, s_past + s_new, d]`` (a sliding-window layer: the last window of it).

    Raises:
        NotImplementedError: the block's declaration names no layer index (``AttentionSpec(layer_index=...)``).
    """
    if layer_index is None:
        raise NotImplementedError(f"{name} was called with a key/value cache but its declaration names no layer index "
                                  f"(the cache's slot for it): declare it, AttentionSpec(layer_index="
                                  f"'self_attn.layer_idx') or an int, or call the model with use_cache=False.")
    return cache.update(k, v, int(layer_index))


def cached_mask(mask: Optional[Tensor], causal: bool, queries: int, keys: int, device: torch.device
                ) -> tuple[Optional[Tensor], Optional[bool]]:
    """The mask and causal flag for ``queries`` new positions attending over ``keys`` (the past first): a given mask
    as it is; no mask and causal over a cached past, the future masked aligned to the last query (the kernels'
    ``is_causal`` aligns to the first: wrong once keys outnumber queries); a single query sees every key."""
    if mask is not None or not causal or queries == keys:
        return mask, (None if mask is not None else causal)
    if queries == 1:
        return None, False
    past = keys - queries
    rows = torch.arange(queries, device=device)[:, None]
    return torch.arange(keys, device=device)[None, :] <= rows + past, False  # [s_new, s_past + s_new], True = attend


def refuse_training_cache(name: str, cache: Any) -> None:
    """A forward with gradients given a cache holding past tokens would attend without them: refused.

    Raises:
        NotImplementedError: naming the fix (``use_cache=False``, or generate under ``torch.no_grad``).
    """
    if cache is None:
        return
    length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else None
    if length is None or length > 0:
        raise NotImplementedError(
            f"{name} was called with a key/value cache holding past tokens while taking gradients: the rewritten "
            f"layers use a key/value cache only without gradients (generation). Train without past_key_values "
            f"(use_cache=False, or the config's default, is fine); generate under torch.no_grad(), or with "
            f"lightning_seqpar.generate.")
