"""Reading a user's block by the dotted paths a declaration names."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Union

import torch.nn as nn

from lightning_seqpar.transformer.tuner_layers import linear_of


def resolve(block: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` inside ``block``; a PEFT layer wrapping a module is looked through for what
    it lacks (``mlp.experts.act_fn`` where LoRA wraps the experts).

    Raises:
        AttributeError: naming the first missing part and what exists there.
    """
    value: Any = block
    done = []
    for part in path.split("."):
        if not hasattr(value, part) and hasattr(linear_of(value), part):
            value = linear_of(value)
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


def maybe_resolve(block: nn.Module, path: str) -> Any:
    """:func:`resolve`, or ``None`` where nothing is at ``path``."""
    try:
        return resolve(block, path)
    except AttributeError:
        return None


def rotary_of(block: nn.Module, rotary: Union[str, Callable[..., Any], None]) -> Optional[Callable[..., Any]]:
    """A declared rotary function: as given, or found by name in ``block``'s own Python module."""
    if rotary is None or callable(rotary):
        return rotary
    return getattr(sys.modules.get(type(block).__module__), rotary, None)


def out_features(module: nn.Module) -> int:
    """Output features of an ``nn.Linear``, of a ``Conv1D`` (weight ``[in, out]``) or of an ``nn.MultiheadAttention``'s
    packed input projection (``3h``)."""
    if isinstance(module, nn.MultiheadAttention):
        return module.in_proj_weight.shape[0]
    module = linear_of(module)  # a PEFT LoRA layer: the projection it wraps
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]
