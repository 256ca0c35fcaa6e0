"""Lightning callbacks: activation recomputation and FLOPs utilization."""

from lightning_seqpar.callbacks.flops_utilization import FlopsUtilization, peak_flops_of
from lightning_seqpar.callbacks.selective_recompute import SelectiveRecompute

__all__ = ["FlopsUtilization", "SelectiveRecompute", "peak_flops_of"]
