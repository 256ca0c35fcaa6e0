"""Activation memory and FLOPs: the paper's analytic model, and measurements on the real layers."""

from lightning_seqpar.memory.activations import (
    CORE_ATTENTION_TERMS,
    TransformerShape,
    context_parallel_buffer_bytes,
    extra_activation_bytes,
    first_stage_activation_bytes,
    interleave_factor,
    layer_activation_bytes,
    layer_activation_terms,
)
from lightning_seqpar.memory.flops import (
    flops_utilization,
    hardware_flops_per_iteration,
    layer_forward_flops,
    model_flops_per_iteration,
    recompute_flops_overhead,
)

__all__ = [
    "CORE_ATTENTION_TERMS",
    "TransformerShape",
    "context_parallel_buffer_bytes",
    "extra_activation_bytes",
    "first_stage_activation_bytes",
    "flops_utilization",
    "hardware_flops_per_iteration",
    "interleave_factor",
    "layer_activation_bytes",
    "layer_activation_terms",
    "layer_forward_flops",
    "model_flops_per_iteration",
    "recompute_flops_overhead",
]
