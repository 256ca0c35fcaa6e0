"""transformers' ``load_balancing_loss_func`` wrapped in a model's module, so that router logits a parallel block marked
(:data:`~lightning_seqpar.moe.balancing.MARK`) get the loss over every rank's tokens
(:func:`~lightning_seqpar.moe.balancing.parallel_load_balancing_loss`) and all others transformers' own."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.moe.balancing import MARK, parallel_load_balancing_loss


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_balancing_loss_func(gate_logits: Any, num_experts: Optional[int] = None, top_k: int = 2,
                                 attention_mask: Optional[Tensor] = None) -> Any:
        marked = isinstance(gate_logits, tuple) and gate_logits and getattr(gate_logits[0], MARK, None)
        if not marked:  # logits of a model that is not split: transformers' own
            return original(gate_logits, num_experts, top_k, attention_mask)
        return parallel_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask, marked)

    load_balancing_loss_func.parallel_original = original  # type: ignore[attr-defined]
    return load_balancing_loss_func


def install_parallel_load_balancing(block: nn.Module) -> None:
    """Wrap ``load_balancing_loss_func`` of ``block``'s transformers module (the causal LM's, which calls it by name)
    once: marked router logits get :func:`parallel_load_balancing_loss`, all others transformers' own function, so a
    model of the same family left unsplit in this process computes as before."""
    module = sys.modules.get(type(block).__module__)
    original = getattr(module, "load_balancing_loss_func", None)
    if original is not None and not hasattr(original, "parallel_original"):
        module.load_balancing_loss_func = _wrapped(original)
