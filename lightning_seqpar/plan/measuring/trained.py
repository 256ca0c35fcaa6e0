"""Which parameters of a model are trained, in a form the activation probes copy onto their small models.

What a layer keeps for backward depends on it: a frozen projection (LoRA's base, a ``--frozen`` name) needs no
weight gradient, so its input is kept only where something else reads it (an adapter, the input's own gradient path
does not). A probe measured on a fully trained copy over-predicts such a run by a third to a half (the plan_check
LoRA rows). So the planner's probes are wrapped with the run's own PEFT LoRA configuration (rank, alpha, dropout,
targets: an adapter's ``[b, s, r]`` rows are a ``b·s`` term, r fixed) and freeze the same parameters by name before
they are rewritten, as the run is.

Names are matched with every integer path component written ``#`` (``model.layers.#.mlp.down_proj.weight``): the
small copy has fewer layers, the same names.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def generic_name(name: str) -> str:
    """``name`` with its integer components (layer and expert indices) written ``#``."""
    return _INDEX.sub("#", name)


@dataclass(frozen=True)
class TrainedParts:
    """How a model is trained, where that differs from "every parameter, no adapters".

    Attributes:
        lora: the model's PEFT LoRA configuration (its active adapter's ``LoraConfig``), or ``None``.
        frozen: the generic names (:func:`generic_name`) of the parameters without ``requires_grad``.
    """

    lora: Any
    frozen: frozenset[str]

    @property
    def key(self) -> str:
        """What identifies this to a cache of probes (the LoRA settings and the frozen names)."""
        return json.dumps([self.lora_settings(), sorted(self.frozen)], sort_keys=True, default=str)

    def lora_settings(self) -> Optional[dict]:
        """The LoRA configuration as JSON values (sets as sorted lists), what :func:`lora_from_settings` reads back;
        ``None`` without LoRA."""
        if self.lora is None:
            return None
        settings = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in self.lora.to_dict().items()}
        return json.loads(json.dumps(settings, sort_keys=True, default=str))


def lora_from_settings(settings: dict) -> Any:
    """PEFT's ``LoraConfig`` of :meth:`TrainedParts.lora_settings` (PEFT's own ``to_dict`` less the type it implies).

    Raises:
        ImportError: PEFT not installed, with the install command.
        TypeError: a setting this PEFT does not take (settings of another version).
    """
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError("Planning LoRA needs PEFT: pip install 'lightning_seqpar[peft]'.") from error
    return LoraConfig(**{k: v for k, v in settings.items() if k != "peft_type"})


def trained_parts_of(model: nn.Module) -> Optional[TrainedParts]:
    """The :class:`TrainedParts` of ``model`` (a Hugging Face causal LM, maybe PEFT-wrapped); ``None`` when every
    parameter is trained and no adapter is attached (the probes' default)."""
    configs = getattr(model, "peft_config", None)
    lora = None
    if isinstance(configs, dict) and configs:
        active = getattr(model, "active_adapter", None)
        lora = configs.get(active if isinstance(active, str) else next(iter(configs)))
    frozen = frozenset(generic_name(n) for n, p in model.named_parameters() if not p.requires_grad)
    if lora is None and not frozen:
        return None
    return TrainedParts(lora, frozen)


def apply_trained_parts(model: nn.Module, parts: Optional[TrainedParts]) -> nn.Module:
    """``model`` trained as ``parts`` says: wrapped with the same LoRA configuration (PEFT), then the same names
    frozen. Returns the model to use (the PEFT wrapper where LoRA is applied).

    Raises:
        ImportError: LoRA without PEFT installed, with the install command.
    """
    if parts is None:
        return model
    if parts.lora is not None:
        try:
            from peft import get_peft_model
        except ImportError as error:
            raise ImportError("Probing a LoRA model needs PEFT: pip install 'lightning_seqpar[peft]'.") from error
        model = get_peft_model(model, copy.deepcopy(parts.lora))
    for name, param in model.named_parameters():
        if generic_name(name) in parts.frozen:
            param.requires_grad_(False)
    return model
