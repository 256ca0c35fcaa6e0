"""The probes' small models, built once and copied for each probe that needs them.

A question prices tens of layouts; each layout's fit probes the same thirteen small configs
(:data:`~.probe._PROBES`) under its own recomputation, precision and split backward. Building one (transformers'
constructor and weight init, then PEFT's LoRA injection) cost twice what copying it does, and every layout built all
thirteen again. Here each is built once and handed out as a deep copy: the rewrite, the cast and recomputation then
change the copy, never the one kept.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.nn as nn


class ProbeModels:
    """Small models by config and trained parts, the ``most`` last used kept (a least-recently-used bound: a mixture's
    small copy holds all its experts).

    Args:
        most: how many built models are kept.
    """

    def __init__(self, most: int = 32) -> None:
        self.most = most
        self._held: OrderedDict[tuple, tuple[nn.Module, torch.Tensor]] = OrderedDict()

    def build(self, small: Any, training: Any = None) -> nn.Module:
        """A new copy of the model of ``small`` (a transformers config) with ``training``'s LoRA and frozen parts
        (:func:`~.trained.apply_trained_parts`), its weights those of a build seeded 0. The global generator is
        left where that build left it, so what the probe draws next is what it drew after a build of its own."""
        from lightning_seqpar.hf.models import build_causal_lm
        from lightning_seqpar.plan.trained import apply_trained_parts

        key = (small.to_json_string(use_diff=False), None if training is None else training.key)
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
            model, state = held
            torch.set_rng_state(state)
            return copy.deepcopy(model)
        torch.manual_seed(0)
        model = apply_trained_parts(build_causal_lm(small), training)
        if self.most:
            self._held[key] = (copy.deepcopy(model), torch.get_rng_state())
            while len(self._held) > self.most:
                self._held.popitem(last=False)
        return model


def probe_models(measured: Optional[dict]) -> Optional[ProbeModels]:
    """The :class:`ProbeModels` kept in ``measured`` (the probes' cache a question shares between its fits), made
    there on first use; ``None`` without one (each probe builds its own)."""
    if measured is None:
        return None
    if _KEY not in measured:
        measured[_KEY] = ProbeModels()
    return measured[_KEY]


_KEY = ("probe models",)
