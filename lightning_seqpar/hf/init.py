"""The initializers of the Hugging Face models inside a module, for building them on the meta device: each
submodule materialized by the strategy is initialized by the model that owns it, as its constructor would."""

from __future__ import annotations

import torch.nn as nn

from lightning_seqpar._compat import hf_init_weights
from lightning_seqpar.transformer.materialize import Initializer


def hf_initializers(root: nn.Module) -> list[tuple[str, Initializer]]:
    """``(qualified name, initializer)`` of every Hugging Face ``PreTrainedModel`` in ``root``; a submodule is
    initialized by the innermost model holding it (``init(module, name)`` initializes ``module``'s own tensors).
    No transformers import: the models are found by what they hold."""
    found = []
    for name, module in root.named_modules():
        init_weights = hf_init_weights(module)
        if init_weights is not None:
            found.append((name, lambda sub, _name, init=init_weights: init(sub)))
    return found
