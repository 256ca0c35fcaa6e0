"""Choose activation recomputation from a memory budget, by the Table 2 model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_seqpar.memory.activations import TransformerShape, layer_activation_bytes


@dataclass(frozen=True)
class RecomputePlan:
    """What to recompute, and the layers' activation bytes on one rank that it leaves (Table 2 × L)."""

    granularity: Literal["none", "selective", "full"]
    full_layers: int
    """layers checkpointed whole (the first ones, Megatron's block method); the rest are selective"""
    activation_bytes: float


def plan_recompute(shape: TransformerShape, t: int, sequence_parallel: bool, memory_budget: float,
                   bytes_per_element: int = 2) -> RecomputePlan:
    """The cheapest recomputation whose L layers' activations (bytes, one rank) fit ``memory_budget``.

    In order of compute cost: nothing; selective (core attention) everywhere; full recomputation of
    the first k layers with selective on the other L − k, for the smallest k that fits (k = L is
    full recomputation of every layer). Per-layer bytes are :func:`layer_activation_bytes`.

    Raises:
        ValueError: even full recomputation of every layer does not fit; names both figures.
    """
    def per_layer(recompute: str) -> float:
        return layer_activation_bytes(shape, t, sequence_parallel, recompute, bytes_per_element)  # type: ignore[arg-type]

    L = shape.L
    none, selective, full = per_layer("none"), per_layer("selective"), per_layer("full")
    if L * none <= memory_budget:
        return RecomputePlan("none", 0, L * none)
    if L * selective <= memory_budget:
        return RecomputePlan("selective", 0, L * selective)
    for k in range(1, L + 1):
        total = k * full + (L - k) * selective
        if total <= memory_budget:
            return RecomputePlan("full" if k == L else "selective", k, total)
    raise ValueError(
        f"No recomputation plan fits memory_budget={memory_budget:.0f} bytes: full recomputation of all {L} "
        f"layers still keeps {L * full:.0f} bytes (s={shape.s}, b={shape.b}, h={shape.h}, t={t}). Lower the "
        f"micro-batch size or sequence length, raise tensor parallelism, or raise the budget."
    )
