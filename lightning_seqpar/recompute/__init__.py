"""Activation recomputation on a rewritten model: selective (core attention, Korthikanti et al. 2022 §5), full
(whole layers, Megatron's uniform/block), by module (core attention, MLP, whole layers, any combination) or a plan chosen from a memory budget. The Lightning callback is
:class:`lightning_seqpar.SelectiveRecompute`; the recomputation itself (with dropout masks replayed) is
:func:`lightning_seqpar.parallel.recomputed`."""

from lightning_seqpar.recompute.apply import (
    RECOMPUTE_MODULES,
    apply_recompute,
    apply_recompute_modules,
    apply_recompute_plan,
    check_recompute_modules,
    fused_attention_layers,
    micro_batch_shape,
    model_shape,
    recompute_counts,
    rewritten_layers,
)
from lightning_seqpar.recompute.planner import RecomputePlan, plan_recompute

__all__ = [
    "RECOMPUTE_MODULES",
    "RecomputePlan",
    "apply_recompute",
    "apply_recompute_modules",
    "apply_recompute_plan",
    "check_recompute_modules",
    "fused_attention_layers",
    "micro_batch_shape",
    "model_shape",
    "plan_recompute",
    "recompute_counts",
    "rewritten_layers",
]
