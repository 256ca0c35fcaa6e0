"""What happens between backward and the optimizer step: gradient finalization over the mesh (sequence-parallel
sums over tp, shared parameters over pp, averages over dp), the sharded gradient norm and clipping, and the
distributed optimizer (ZeRO-1); optimizers that read whole matrices (Muon) exact on shards."""

from lightning_seqpar.optim.distributed_optimizer import DistributedOptimizer, distribute_optimizers, optimizer_state_bytes
from lightning_seqpar.optim.grad_buckets import Buckets, GradientBuckets, NoBuckets, gradient_buckets
from lightning_seqpar.optim.gradients import clip_grad_norm_, finalize_gradients, grad_norm
from lightning_seqpar.optim.muon import Muon

__all__ = ["Buckets", "DistributedOptimizer", "GradientBuckets", "NoBuckets", "clip_grad_norm_", "distribute_optimizers",
           "finalize_gradients", "grad_norm", "gradient_buckets", "Muon", "optimizer_state_bytes"]
