"""Which layers of a model split their backward into B and W (:mod:`.weight_gradients`): the column- and row-parallel
linears, and any module that names its split weights by a ``weight_gradient_parameters()`` method (a mixture's
experts, :mod:`lightning_seqpar.moe.expert_product`; a LoRA adapter's ``lora_A`` and ``lora_B``,
:mod:`lightning_seqpar.transformer.lora`), told by one call."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from lightning_seqpar.tensor_parallel.layers import ColumnParallelInProjection, ColumnParallelLinear, RowParallelLinear
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore


def split_weight_gradients(model: nn.Module, store: Optional[WeightGradientStore]) -> int:
    """Make every column- and row-parallel linear and every experts module of ``model`` split its backward into B and W
    through ``store``
    (``None``: unsplit again); return how many layers were set. ``store.deferred`` then holds the parameters whose
    gradient arrives in W (what gradient reduction arms before the last W rather than the last B)."""
    # A layer may keep its weight gradient in B (``splits_weight_gradient = False``): the vocabulary-parallel LM
    # head, whose W would hold the logits' gradient, [s, b, v/t], for every micro-batch waiting on the last stage.
    layers = [m for m in model.modules()
              if (isinstance(m, (ColumnParallelLinear, RowParallelLinear, ColumnParallelInProjection))
                  or callable(getattr(m, "weight_gradient_parameters", None)))
              and getattr(m, "splits_weight_gradient", True)]
    for layer in layers:
        layer.weight_gradients = store
        if store is not None:  # a row-parallel bias (and an expert's) is added outside the split product: in B
            held = [layer.weight] if isinstance(layer, RowParallelLinear) else \
                layer.weight_gradient_parameters() if hasattr(layer, "weight_gradient_parameters") else \
                list(layer.parameters(recurse=False))
            store.deferred |= {id(p) for p in held if p is not None and p.requires_grad}
    return len(layers)
