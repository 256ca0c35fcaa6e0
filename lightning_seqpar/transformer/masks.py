"""Attention masks: every convention a caller may pass, turned into what core attention adds to its scores.

One place decides what a mask means, so that a layer never allocates an ``s × s`` tensor per call:

- the causal (future) mask is a bool ``[s, s]`` built once per sequence length and device (:class:`FutureMask`);
- a Hugging Face mask (``[b, 1, s, s]``; bool with ``True`` = attend, or additive float) is used as given: the
  model builds it once per forward and every layer reads the same tensor (:func:`apply_mask`);
- torch's conventions (``src_mask`` bool with ``True`` = masked, or float; ``src_key_padding_mask`` ``[b, s]``;
  ``is_causal``) are combined by :func:`torch_attention_bias` into one additive bias (``None`` when there is only
  causality, which the cached future mask applies), once per stack forward
  (:class:`~lightning_seqpar.transformer.encoder.ParallelTransformerEncoder`) and passed down to its layers; layers
  the user's code calls one by one with the same masks share one combination through a :class:`MaskCache`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_seqpar._compat import tensor_version
from lightning_seqpar.parallel.collectives import ParallelGroup


class FutureMask:
    """The bool ``[s, s]`` mask of future positions (``True`` above the diagonal), kept for the last shape asked.

    Reused, not rebuilt: a mask allocated per call would add ``s²`` bytes to every layer's saved activations
    (``masked_fill`` keeps its mask for backward), a term the paper's count does not have.
    """

    def __init__(self) -> None:
        self._mask: Optional[Tensor] = None

    def __call__(self, s: int, device: torch.device) -> Tensor:
        if torch.compiler.is_compiling():  # built inside the graph, where the compiler keeps or rebuilds it: no cache
            return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        mask = self._mask
        if mask is None or mask.shape[0] != s or mask.device != device:
            mask = self._mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        return mask

    def cached(self) -> Optional[Tensor]:
        """The mask kept now (``None``: none yet): shared by every call, never an activation of one."""
        return self._mask

    def __getstate__(self) -> dict:  # a cache: not part of a copied or pickled model
        return {"_mask": None}


class MaskCache:
    """The last combination of torch-convention masks, reused while the same mask tensors come back: the layers of one
    forward, called one by one with the model's ``src_mask`` / ``src_key_padding_mask``, build it once, not once per
    layer. Keyed by the masks' identity (weak references: a freed mask is never mistaken for a new one) and version (a
    mask changed in place is combined again). One per rewrite (:class:`~lightning_seqpar.rewriting.RewriteContext`
    holds it); not copied with a model."""

    def __init__(self) -> None:
        self._inputs: tuple = ()
        self._rest: tuple = ()
        self._value: Any = None

    def get(self, masks: tuple[Optional[Tensor], ...], rest: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, or what it returned for the same ``masks`` (tensors or ``None``) and ``rest`` last time."""
        same = len(masks) == len(self._inputs) and rest == self._rest and all(
            (m is None and held is None) or (m is not None and held is not None and held[0]() is m
                                             and held[1] == tensor_version(m))
            for m, held in zip(masks, self._inputs))
        if not same:
            self._value = build()
            self._inputs = tuple(None if m is None else (weakref.ref(m), tensor_version(m)) for m in masks)
            self._rest = rest
        return self._value

    def __getstate__(self) -> dict:  # a cache: a copied or pickled model starts without it
        return {"_inputs": (), "_rest": (), "_value": None}


def apply_mask(scores: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``scores`` ``[b, a, s, s]`` with a Hugging Face-convention mask applied: bool (``True`` = attend) through
    ``torch.where`` (keeps only the caller's mask for backward, no new ``s²`` tensor), float added."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return torch.where(mask, scores, scores.new_tensor(float("-inf")))
    return scores + mask.to(scores.dtype)


def _torch_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:  # torch's convention: True = not allowed to attend
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def torch_attention_bias(
    attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    s: int,
    b: int,
    num_heads: int,
    group: ParallelGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Optional[Tensor], bool]:
    """torch's masks (``nn.TransformerEncoderLayer``) as one additive bias for this rank's heads, and whether future
    positions are masked besides (``is_causal`` without ``attn_mask``: by the core attention's cached mask, no
    ``s × s`` tensor made here).

    Args:
        attn_mask: ``[s, s]`` or ``[b·a, s, s]`` (global heads), bool (``True`` = masked) or float.
        key_padding_mask: ``[b, s]``, bool (``True`` = padding) or float.
        is_causal: mask future positions when ``attn_mask`` is not given.
        s, b: the global sequence length and the batch size; num_heads: a (global).

    Returns:
        ``None`` or an additive float tensor broadcastable to ``[b, a/t, s, s]`` (Hugging Face's additive convention,
        so :func:`apply_mask` applies it); and the causal flag.
    """
    bias = None
    causal = attn_mask is None and is_causal
    if attn_mask is not None:
        bias = _torch_additive(attn_mask, dtype)
        if bias.dim() == 2:
            bias = bias.view(1, 1, s, s)
        else:  # per-head masks: keep this rank's heads
            local = num_heads // group.size
            bias = bias.view(b, num_heads, s, s)[:, group.rank * local : (group.rank + 1) * local]
    if key_padding_mask is not None:
        padding = _torch_additive(key_padding_mask, dtype).view(b, 1, 1, s)
        bias = padding if bias is None else bias + padding
    return bias, causal
