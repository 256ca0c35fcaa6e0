"""ZeRO stage 1 over the data-parallel group: each data-parallel rank keeps 1/d of the optimizer state.

Megatron-LM's distributed optimizer (``--use-distributed-optimizer``) and DeepSpeed's ZeRO-1 shard the
optimizer state over the d data-parallel replicas: rank r updates only its part of the parameters and
the updated parameters are then sent to the other replicas. This is
``torch.distributed.optim.ZeroRedundancyOptimizer`` (Rajbhandari et al. 2020), which we use rather than
writing our own: it wraps any ``torch.optim`` class, runs on gloo and NCCL, and keeps
``param_groups`` for learning-rate schedulers. Its partition is by whole parameters (largest first,
greedy), so a rank holds about, not exactly, 1/d of the state.

Gradients are reduced as before (:func:`lightning_seqpar.optim.finalize_gradients`: sequence-parallel
sums over tp, shared-module sums over pp, the mean over dp), so clipping, accumulation and mixed
precision see the same gradients as without ZeRO; the step then costs one broadcast of each updated
parameter from its owner, ``(d-1)/d`` of the parameter bytes per rank, instead of Megatron's
reduce-scatter + all-gather (same volume in total, an all-reduce where Megatron reduce-scatters).
"""

from __future__ import annotations

import warnings

import inspect
from typing import Any, Sequence

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_seqpar.parallel.collectives import ParallelGroup


def shard_optimizer(optimizer: Optimizer, data: ParallelGroup) -> ZeroRedundancyOptimizer:
    """``optimizer`` rebuilt as ZeRO-1 over the data-parallel group ``data``: same class, same parameter
    groups and settings, its state partitioned over the d ranks.

    Raises:
        ValueError: the optimizer already holds state (it must be fresh, as from ``configure_optimizers``).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError(f"zero=1 shards a fresh optimizer; this {type(optimizer).__name__} already holds state. "
                         f"Return a new optimizer from configure_optimizers.")
    groups = [dict(group) for group in optimizer.param_groups]
    # `defaults` can hold entries the constructor does not take (AdamW's decoupled_weight_decay); the groups keep them.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=data.group, **defaults)


def shard_optimizers(optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any],
                     data: ParallelGroup) -> list[ZeroRedundancyOptimizer]:
    """:func:`shard_optimizer` for each, and each learning-rate scheduler pointed at its optimizer's
    replacement (a scheduler writes ``lr`` into ``scheduler.optimizer.param_groups``). With one data-parallel rank
    there is nothing to shard: a warning says so (the run is as with ``zero=0``, plus ZeRO's bookkeeping)."""
    if data.size == 1:
        warnings.warn("zero=1 shards the optimizer state over the data-parallel ranks, and this run has one (dp = 1): "
                      "nothing is saved. Use zero=0, or more devices than tp·pp.", stacklevel=2)
    sharded = [shard_optimizer(optimizer, data) for optimizer in optimizers]
    for config in lr_scheduler_configs:
        for old, new in zip(optimizers, sharded):
            if getattr(config.scheduler, "optimizer", None) is old:
                config.scheduler.optimizer = new
    return sharded


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state this rank holds (ZeRO-1: its partition's), summed over every state tensor."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(value.numel() * value.element_size() for state in local.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))
