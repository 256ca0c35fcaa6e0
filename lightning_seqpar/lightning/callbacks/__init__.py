"""Lightning callbacks: activation recomputation and offload, FLOPs utilization, parameter counts of the whole model, the
aux-loss-free expert bias update, host reads counted in the training step."""

from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
from lightning_seqpar.lightning.callbacks.expert_bias import ExpertBiasUpdate
from lightning_seqpar.lightning.callbacks.flops_utilization import FlopsUtilization, peak_flops_of
from lightning_seqpar.lightning.callbacks.host_syncs import HostReads, HostSyncCounter, counting_host_reads
from lightning_seqpar.lightning.callbacks.layout_report import LayoutReport
from lightning_seqpar.lightning.callbacks.model_summary import ParallelModelSummary, parameter_counts
from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute

__all__ = ["ActivationOffload", "ExpertBiasUpdate", "FlopsUtilization", "HostReads", "HostSyncCounter", "LayoutReport", "ParallelModelSummary",
           "SelectiveRecompute", "counting_host_reads", "parameter_counts", "peak_flops_of"]
