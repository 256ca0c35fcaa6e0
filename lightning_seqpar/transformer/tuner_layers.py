"""Layers a PEFT method inserted into a model, recognized without importing PEFT (an optional extra)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def is_peft_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer a PEFT method inserted (``peft.tuners.tuners_utils.BaseTunerLayer``), told by its
    class hierarchy."""
    return any(cls.__name__ == "BaseTunerLayer" and cls.__module__.startswith("peft.") for cls in type(module).__mro__)


def linear_of(module: Any) -> Any:
    """The projection a PEFT tuner layer wraps (its ``base_layer``), else ``module`` itself: what a layout check or
    a shape reads."""
    return module.get_base_layer() if is_peft_tuner_layer(module) and hasattr(module, "get_base_layer") else module
