"""Lightning callbacks: activation recomputation and offload, FLOPs utilization, parameter counts of the whole model, the
aux-loss-free expert bias update, host reads counted in the training step, a step's peak of live tensor bytes, replies
sampled during training."""

from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
from lightning_seqpar.lightning.callbacks.expert_bias import ExpertBiasUpdate
from lightning_seqpar.lightning.callbacks.flops_utilization import FlopsUtilization, peak_flops_of
from lightning_seqpar.lightning.callbacks.host_syncs import HostReads, HostSyncCounter, counting_host_reads
from lightning_seqpar.lightning.callbacks.layout_report import LayoutReport
from lightning_seqpar.lightning.callbacks.model_summary import ParallelModelSummary, parameter_counts
from lightning_seqpar.lightning.callbacks.sample_text import SampleText
from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute
from lightning_seqpar.lightning.callbacks.step_peak import StepPeak, model_state

__all__ = ["ActivationOffload", "ExpertBiasUpdate", "FlopsUtilization", "HostReads", "HostSyncCounter", "LayoutReport",
           "ParallelModelSummary", "SampleText", "SelectiveRecompute", "StepPeak", "counting_host_reads", "model_state",
           "parameter_counts", "peak_flops_of"]
