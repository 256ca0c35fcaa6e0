"""A 16-bit residual stream under autocast (Megatron-LM's default, without ``--fp32-residual-connection``).

Under autocast (Lightning's ``bf16-mixed`` / ``16-mixed``) the residual stream stays float32: the embedding
output is float32 and each residual addition promotes the 16-bit sub-block output to it. So the hidden state
between layers, the pipeline transfers of it and the norm inputs kept for backward are 4 bytes per element,
where Table 2 of Korthikanti et al. (2022) counts 2: about ``4·sbh/t`` per layer over ``34·sbh/t``.

:func:`cast_residual_stream` casts each layer's incoming hidden state to autocast's dtype; the sub-block
outputs added to it are already 16-bit (linear outputs under autocast, dropout keeps the dtype), so the whole
stream stays 16-bit from the first layer on. This changes the numbers: the residual additions round to 16
bits, as they do in Megatron-LM's bf16 training. A parallel model and a single-device one with the same layers
cast train alike (``tests/lightning/test_precision.py``).

A 16-bit stream is not yet a 16-bit norm input kept for backward: CUDA autocast runs ``layer_norm`` in float32
by casting its input, and the norm keeps that float32 copy (Hugging Face RMSNorms upcast in their own forward and
keep float32 copies too). So the norms inside the layers keep their 16-bit input instead and recompute in
backward (:mod:`lightning_seqpar.transformer.upcast`): the same numbers, 2 bytes per element.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from lightning_seqpar.tensor_parallel.layers import autocast_input
from lightning_seqpar.transformer.upcast import keeping_16_bit_input


def _to_autocast_dtype(hidden: Any) -> Any:
    return autocast_input(hidden) if isinstance(hidden, torch.Tensor) else hidden


def _cast_hidden(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    if args:
        return (_to_autocast_dtype(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:  # Hugging Face decoder layers may be called with keywords only
        return args, {**kwargs, "hidden_states": _to_autocast_dtype(kwargs["hidden_states"])}
    return None


def is_norm(module: nn.Module) -> bool:
    """``nn.LayerNorm``, ``nn.RMSNorm`` or a class named ``*LayerNorm`` / ``*RMSNorm`` (Hugging Face's)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


class _NormKeeping16BitInput:
    """``norm.forward`` through :func:`keeping_16_bit_input`. A plain object rather than a bound method, so the norm
    still pickles and deep-copies (a bound method on an instance pickles as a lookup of its name on the class)."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = partial(type(self.norm).forward, self.norm)
        if not args or not isinstance(args[0], torch.Tensor):  # called with keywords: as it was
            return forward(*args, **kwargs)
        return keeping_16_bit_input(forward, *args, **kwargs)


class _NormForwardHandle:
    """Undoes :func:`keep_16_bit_norm_inputs` on one norm."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm

    def remove(self) -> None:
        self.norm.__dict__.pop("forward", None)


def keep_16_bit_norm_inputs(norm: nn.Module) -> _NormForwardHandle:
    """Under autocast, make ``norm`` keep its 16-bit input for backward instead of the float32 copy it computes on.

    The norm's forward runs through :func:`~lightning_seqpar.transformer.upcast.keeping_16_bit_input` (recomputed in
    backward when its input is 16-bit and autocast is on; otherwise as before). Numerically identical; one
    normalization more per backward. Installed on the instance (``norm.forward``), so parameter names and
    state-dict keys stay.
    """
    norm.forward = _NormKeeping16BitInput(norm)  # type: ignore[method-assign]
    return _NormForwardHandle(norm)


def cast_residual_stream(layers: Iterable[nn.Module]) -> list[Union[RemovableHandle, _NormForwardHandle]]:
    """Cast the hidden state entering each of ``layers`` to autocast's dtype when autocast is on for its device,
    and make the norms inside them keep their 16-bit inputs (:func:`keep_16_bit_norm_inputs`).

    The hidden state is the first positional argument (or ``hidden_states=``), ``[s, b, h]`` or ``[s/t, b, h]``
    under sequence parallelism; only a float32 one is cast, and only inside autocast, so outside autocast and
    under ``32-true`` / ``64-true`` / ``bf16-true`` the layers compute what they did. Works on rewritten
    :class:`~lightning_seqpar.transformer.roles.ParallelLayer` modules and on the single-device blocks they
    replace alike (a forward pre-hook), which is how a single-process reference gets the same numbers.

    Returns:
        Handles whose ``remove()`` undoes each change.

    Source: Megatron-LM keeps the residual in the parameters' dtype unless ``--fp32-residual-connection``.
    """
    handles: list[Union[RemovableHandle, _NormForwardHandle]] = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(_cast_hidden, with_kwargs=True))
        handles.extend(keep_16_bit_norm_inputs(m) for m in layer.modules() if is_norm(m))
    return handles
