"""A transformers key/value cache for a Hugging Face causal LM, as its forward takes it."""

from __future__ import annotations

import inspect
from typing import Any


def new_cache(model: Any) -> dict[str, Any]:
    """A fresh transformers ``DynamicCache`` for ``model``'s config (sliding-window layers keep their window), under
    the keyword the model's forward takes it by: ``cache`` from transformers 5.24, ``past_key_values`` before. A PEFT
    wrapper passes it on to its base model."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
    return {name: DynamicCache(config=base.config)}
