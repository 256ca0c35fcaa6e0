"""``SelectiveRecompute``: the paper's selective activation recomputation, as a Lightning callback."""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
import torch.nn as nn

from lightning_seqpar.recompute import (
    apply_recompute,
    apply_recompute_modules,
    check_recompute_modules,
    apply_recompute_plan,
    fused_attention_layers,
    micro_batch_shape,
    model_shape,
)
from lightning_seqpar.recompute.planner import RecomputePlan, plan_recompute


class SelectiveRecompute(pl.Callback):
    """Activation recomputation for the layers :class:`~lightning_seqpar.SeqParallelStrategy` rewrote.

    Args:
        granularity: ``"selective"`` (core attention only, the default and the paper's proposal),
            ``"full"`` (whole layers) or ``"auto"`` (the cheapest plan that fits ``memory_budget``, see
            :func:`~lightning_seqpar.recompute.plan_recompute`: none → selective → full on the fewest
            first layers with selective on the rest).
        method: for ``"full"``, ``"uniform"`` or ``"block"`` (Megatron-LM ``--recompute-method``).
        num_layers: for ``"full"``, layers per uniform chunk or layers checkpointed by ``"block"``.
        memory_budget: for ``"auto"``: bytes of layer activations allowed per rank and micro-batch.
        bytes_per_element: for ``"auto"``: activation bytes (default: the parameters' element size).
        modules: recompute by module instead (Megatron-Core's ``recompute_modules``): any combination of
            ``"core_attn"`` (the same as ``"selective"``), ``"layernorm"`` (the norms' outputs rebuilt from their
            inputs when the projections' backward reads them), ``"mlp"`` (a dense MLP's inner activations: its input is
            kept, its all-gather, fc1 and activation run again in backward), ``"moe_act"`` (the experts' activation),
            ``"shared_experts"`` (a mixture's shared expert), ``"moe"`` (a whole mixture of experts) and ``"full"``
            (with ``method`` and ``num_layers``; the other modules recomputed in the layers it leaves);
            :func:`apply_recompute_modules`, :data:`~lightning_seqpar.recompute.RECOMPUTE_MODULES`.

    Applied when fitting starts, after the strategy has rewritten the model (``"auto"``: at the first
    training batch, whose first tensor, token ids ``[b, s]``, gives s and b). Training is numerically identical to no recomputation
    (dropout masks are replayed). ``plan`` holds the ``"auto"`` choice.

    Raises:
        ValueError: see :func:`apply_recompute` and :func:`apply_recompute_modules`; ``"auto"`` without a positive
            ``memory_budget``, or with ``modules``; a budget that nothing fits.
    """

    def __init__(
        self,
        granularity: Literal["selective", "full", "auto"] = "selective",
        method: Literal["uniform", "block"] = "uniform",
        num_layers: Optional[int] = None,
        memory_budget: Optional[float] = None,
        bytes_per_element: Optional[int] = None,
        modules: Optional[list[str]] = None,
    ) -> None:
        if granularity not in ("selective", "full", "auto") and modules is None:
            raise ValueError(f"granularity must be 'selective', 'full' or 'auto', got {granularity!r}.")
        if modules is not None and granularity == "auto":
            raise ValueError(f"granularity='auto' plans the recomputation itself; modules={modules!r} names it. Give "
                             f"one of them.")
        if granularity == "auto" and (memory_budget is None or memory_budget <= 0):
            raise ValueError(f"granularity='auto' needs memory_budget > 0 (bytes), got {memory_budget!r}.")
        apply_recompute(nn.Module(), "none", method, num_layers)  # validates method and num_layers
        self.modules = None if modules is None else check_recompute_modules(modules)
        if self.modules is not None:
            # what the memory report and the planner read: the paper's granularity these modules amount to
            granularity = "full" if "full" in self.modules else "selective" if self.modules == ["core_attn"] else (
                "modules")
        self.granularity, self.method, self.num_layers = granularity, method, num_layers
        self.memory_budget, self.bytes_per_element = memory_budget, bytes_per_element
        self.plan: Optional[RecomputePlan] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.modules is not None:
            apply_recompute_modules(pl_module, self.modules, self.method, self.num_layers)
        elif self.granularity != "auto":
            apply_recompute(pl_module, self.granularity, self.method, self.num_layers)
        fused = fused_attention_layers(pl_module)
        if fused and self.granularity in ("selective", "auto"):
            rank_zero_warn(
                f"{len(fused)} rewritten layer(s) use a fused attention kernel (attn_implementation='sdpa'), which keeps "
                f"no s² tensor: selective recomputation has nothing to recompute there and leaves them as they are. "
                f"Use granularity='full' to trade compute for memory in those layers, or attn_implementation='eager' "
                f"for the explicit core attention (Korthikanti et al. 2022 §5)."
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.granularity == "auto" and self.plan is None:
            self.plan = self.choose(pl_module, *micro_batch_shape(batch))

    def choose(self, model: nn.Module, s: int, b: int) -> RecomputePlan:
        """Plan for sequences of ``s`` tokens in micro-batches of ``b``, and apply it to ``model``."""
        assert self.memory_budget is not None
        shape, t, sp = model_shape(model, s, b)
        element = self.bytes_per_element or next(model.parameters()).element_size()
        plan = plan_recompute(shape, t, sp, self.memory_budget, element)
        apply_recompute_plan(model, plan)
        return plan
