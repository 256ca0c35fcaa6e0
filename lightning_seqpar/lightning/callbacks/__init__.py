"""Lightning callbacks: activation recomputation, FLOPs utilization, parameter counts of the whole model, the
aux-loss-free expert bias update."""

from lightning_seqpar.lightning.callbacks.expert_bias import ExpertBiasUpdate
from lightning_seqpar.lightning.callbacks.flops_utilization import FlopsUtilization, peak_flops_of
from lightning_seqpar.lightning.callbacks.layout_report import LayoutReport
from lightning_seqpar.lightning.callbacks.model_summary import ParallelModelSummary, parameter_counts
from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute

__all__ = ["ExpertBiasUpdate", "FlopsUtilization", "LayoutReport", "ParallelModelSummary", "SelectiveRecompute", "parameter_counts", "peak_flops_of"]
