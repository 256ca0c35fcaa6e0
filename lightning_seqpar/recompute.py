"""``SelectiveRecompute``: the paper's selective activation recomputation, as a Lightning callback."""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch.nn as nn

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.planner import RecomputePlan, plan_recompute
from lightning_seqpar.transformer.core_attention import CoreAttention


def _layer_stacks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(containers with ``recompute_chunks``, bare layers with ``recompute_layer`` outside any container).

    A stack split over pipeline stages counts as bare layers: a checkpointed chunk must not span a
    stage boundary, so each held layer is checkpointed on its own.
    """
    stacks, layers = [], []
    inside: set[int] = set()
    for module in model.modules():
        if hasattr(module, "recompute_chunks") and not any(hasattr(m, "pipeline_stage") for m in module.modules()):
            stacks.append(module)
            inside.update(id(m) for m in module.modules() if m is not module)
    for module in model.modules():
        if hasattr(module, "recompute_layer") and id(module) not in inside:
            layers.append(module)
    return stacks, layers


def apply_recompute(
    model: nn.Module,
    granularity: Literal["selective", "full", "none"] = "selective",
    method: Literal["uniform", "block"] = "uniform",
    num_layers: Optional[int] = None,
) -> int:
    """Configure recomputation on every rewritten layer of ``model``; return how many places it set.

    * ``"selective"``: checkpoint each :class:`CoreAttention` (QKᵀ, softmax, softmax dropout, ·V),
      Korthikanti et al. 2022 §5.
    * ``"full"``: checkpoint whole layers, Megatron's ``--recompute-method``:
      ``"uniform"`` checkpoints every chunk of ``num_layers`` consecutive layers (default 1);
      ``"block"`` checkpoints the first ``num_layers`` layers of each stack individually (default all).
    * ``"none"``: undo either.

    Raises:
        ValueError: for an unknown granularity/method, ``num_layers < 1``, uniform chunks of more than one
            layer on layers that are not inside a stack module, or a model with no layer to recompute.
    """
    if granularity not in ("selective", "full", "none"):
        raise ValueError(f"granularity must be 'selective', 'full' or 'none', got {granularity!r}.")
    if method not in ("uniform", "block"):
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}.")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    attentions = [m for m in model.modules() if isinstance(m, CoreAttention)]
    stacks, layers = _layer_stacks(model)
    for m in attentions:
        m.recompute = granularity == "selective"
    for stack in stacks:
        stack.recompute_chunks = []
    for layer in layers:
        layer.recompute_layer = False
    if granularity == "none":
        return 0
    if granularity == "selective":
        if not attentions:
            raise ValueError("Selective recomputation found no CoreAttention module: is the model rewritten?")
        return len(attentions)
    if not stacks and not layers:
        raise ValueError("Full recomputation found no rewritten transformer layer in the model.")
    count = 0
    for stack in stacks:
        n = stack.num_layers if hasattr(stack, "num_layers") else len(stack.transformer.h)
        if method == "uniform":
            size = num_layers or 1
            stack.recompute_chunks = [(i, min(i + size, n)) for i in range(0, n, size)]
        else:
            stack.recompute_chunks = [(i, i + 1) for i in range(min(num_layers or n, n))]
        count += len(stack.recompute_chunks)
    if layers and method == "uniform" and (num_layers or 1) > 1:
        raise ValueError(
            f"Uniform chunks of {num_layers} layers need the layers inside a stack (nn.TransformerEncoder or the "
            f"reference GPT) on one pipeline stage; these layers are called one by one by user code or split over "
            f"pipeline stages. Use num_layers=1 or method='block'."
        )
    chosen = layers if method == "uniform" else layers[: num_layers or len(layers)]
    for layer in chosen:
        layer.recompute_layer = True
    return count + len(chosen)


def _selective_outside_full(model: nn.Module) -> None:
    """Turn on selective recomputation in every layer that is not checkpointed whole."""
    stacks, layers = _layer_stacks(model)
    outside = [layer for stack in stacks for i, layer in enumerate(_stack_layers(stack))
               if not any(lo <= i < hi for lo, hi in stack.recompute_chunks)]
    outside += [layer for layer in layers if not layer.recompute_layer]
    for layer in outside:
        for m in layer.modules():
            if isinstance(m, CoreAttention):
                m.recompute = True


def recompute_counts(model: nn.Module) -> tuple[int, int]:
    """(layers with selective recomputation, layers checkpointed whole) of a rewritten model."""
    stacks, layers = _layer_stacks(model)
    full = sum(hi - lo for stack in stacks for lo, hi in stack.recompute_chunks)
    full += sum(1 for layer in layers if layer.recompute_layer)
    selective = sum(1 for m in model.modules() if isinstance(m, CoreAttention) and m.recompute)
    return selective, full


def micro_batch_shape(batch: Any) -> tuple[int, int]:
    """(s, b) of a batch whose first tensor (or the batch itself) is token ids ``[b, s]``."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    b, s = tokens.shape[-2:]
    return s, b


def _stack_layers(stack: nn.Module) -> list[nn.Module]:
    return list(stack.layers if hasattr(stack, "layers") else stack.transformer.h)


def rewritten_layers(model: nn.Module) -> list[nn.Module]:
    """The rewritten transformer layers of ``model``, in order."""
    return [m for m in model.modules() if hasattr(m, "recompute_layer")]


def model_shape(model: nn.Module, s: int, b: int) -> tuple[TransformerShape, int, bool]:
    """(shape, t, sequence_parallel) of a rewritten model, for sequences of ``s`` tokens in micro-batches of ``b``.

    Raises:
        ValueError: no rewritten layer in ``model``.
    """
    layers = rewritten_layers(model)
    if not layers:
        raise ValueError("granularity='auto' found no rewritten transformer layer: is the model rewritten?")
    h, a, f, t, sp = layers[0].global_dims()
    return TransformerShape(s=s, b=b, h=h, a=a, L=len(layers), ffn_hidden_size=f), t, sp


class SelectiveRecompute(pl.Callback):
    """Activation recomputation for the layers :class:`~lightning_seqpar.SeqParallelStrategy` rewrote.

    Args:
        granularity: ``"selective"`` (core attention only, the default and the paper's proposal),
            ``"full"`` (whole layers) or ``"auto"`` (the cheapest plan that fits ``memory_budget``, see
            :func:`~lightning_seqpar.memory.planner.plan_recompute`: none → selective → full on the fewest
            first layers with selective on the rest).
        method: for ``"full"``, ``"uniform"`` or ``"block"`` (Megatron-LM ``--recompute-method``).
        num_layers: for ``"full"``, layers per uniform chunk or layers checkpointed by ``"block"``.
        memory_budget: for ``"auto"``: bytes of layer activations allowed per rank and micro-batch.
        bytes_per_element: for ``"auto"``: activation bytes (default: the parameters' element size).

    Applied when fitting starts, after the strategy has rewritten the model (``"auto"``: at the first
    training batch, whose first tensor, token ids ``[b, s]``, gives s and b). Training is numerically identical to no recomputation
    (dropout masks are replayed). ``plan`` holds the ``"auto"`` choice.

    Raises:
        ValueError: see :func:`apply_recompute`; ``"auto"`` without a positive ``memory_budget``, or a
            budget that nothing fits.
    """

    def __init__(
        self,
        granularity: Literal["selective", "full", "auto"] = "selective",
        method: Literal["uniform", "block"] = "uniform",
        num_layers: Optional[int] = None,
        memory_budget: Optional[float] = None,
        bytes_per_element: Optional[int] = None,
    ) -> None:
        if granularity not in ("selective", "full", "auto"):
            raise ValueError(f"granularity must be 'selective', 'full' or 'auto', got {granularity!r}.")
        if granularity == "auto" and (memory_budget is None or memory_budget <= 0):
            raise ValueError(f"granularity='auto' needs memory_budget > 0 (bytes), got {memory_budget!r}.")
        apply_recompute(nn.Module(), "none", method, num_layers)  # validates method and num_layers
        self.granularity, self.method, self.num_layers = granularity, method, num_layers
        self.memory_budget, self.bytes_per_element = memory_budget, bytes_per_element
        self.plan: Optional[RecomputePlan] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.granularity != "auto":
            apply_recompute(pl_module, self.granularity, self.method, self.num_layers)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.granularity == "auto" and self.plan is None:
            self.plan = self.choose(pl_module, *micro_batch_shape(batch))

    def choose(self, model: nn.Module, s: int, b: int) -> RecomputePlan:
        """Plan for sequences of ``s`` tokens in micro-batches of ``b``, and apply it to ``model``."""
        assert self.memory_budget is not None
        shape, t, sp = model_shape(model, s, b)
        element = self.bytes_per_element or next(model.parameters()).element_size()
        plan = plan_recompute(shape, t, sp, self.memory_budget, element)
        if plan.full_layers:
            apply_recompute(model, "full", "block", plan.full_layers)
            if plan.full_layers < shape.L:
                _selective_outside_full(model)
        else:
            apply_recompute(model, plan.granularity)
        return plan
