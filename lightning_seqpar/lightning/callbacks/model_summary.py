"""``ParallelModelSummary``: parameter counts of the whole model and of this rank, per top-level module."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_seqpar.lightning.strategy import SeqParallelStrategy
from lightning_seqpar.tensor_parallel.sharding import full_shape
from lightning_seqpar.parallel.placement import counted_on_stage, is_pipeline_tied


def whole_numel(param: nn.Parameter) -> int:
    """Elements of the single-device parameter this rank holds a shard (or a copy) of (vocabulary padding excluded;
    an expert split along its width too counted whole)."""
    numel = 1
    for size in full_shape(param):
        numel *= size
    return numel


def parameter_counts(module: nn.Module, strategy: Any, trainable: bool = False) -> dict[str, tuple[int, int]]:
    """``{top-level child: (whole-model parameters, this rank's parameters)}`` plus ``"total"``; ``trainable``: of
    the parameters that train only (``requires_grad``: LoRA's adapters, not its frozen base).

    Collective under pipeline parallelism (every rank must call it): stage-local layers are counted on
    the stage holding them (a pipeline-tied embedding on the first) and summed over the pipeline group.
    """
    names = [name for name, _ in module.named_children()]
    pipeline_rank = strategy.mesh.pipeline.rank if isinstance(strategy, SeqParallelStrategy) else 0
    whole_local, whole_shared, here = [], [], []
    for name in names:
        params = [p for p in dict(getattr(module, name).named_parameters()).values()  # tied weights once
                  if p.requires_grad or not trainable]
        whole_local.append(sum(whole_numel(p) for p in params if counted_on_stage(p, pipeline_rank)))
        whole_shared.append(sum(whole_numel(p) for p in params if not counted_on_stage(p, pipeline_rank)
                                and not is_pipeline_tied(p)))
        here.append(sum(p.numel() for p in params))
    local = torch.tensor(whole_local, dtype=torch.float64)
    if isinstance(strategy, SeqParallelStrategy) and strategy.mesh.pp > 1:
        strategy.mesh.pipeline.all_reduce(local)
    counts = {name: (int(local[i]) + whole_shared[i], here[i]) for i, name in enumerate(names)
              if int(local[i]) + whole_shared[i]}  # modules without parameters (metrics) are left out
    counts["total"] = (sum(w for w, _ in counts.values()), sum(h for _, h in counts.values()))
    return counts


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


class ParallelModelSummary(pl.Callback):
    """Print, when fitting starts, each top-level module's parameter count in the whole (single-device)
    model and on this rank (its tensor-parallel shard and pipeline stage). Lightning's ``ModelSummary``
    sees only this rank's shards (and reports 0 FLOPs for them): use this one with ``enable_model_summary=False``.

    Attributes:
        counts: what was printed, ``{module: (whole, this rank)}``, set on every rank.
    """

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int]] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counts = parameter_counts(pl_module, trainer.strategy)
        width = max(len(name) for name in self.counts)
        lines = [f"{'module':<{width}}  {'whole model':>12}  {'rank 0':>12}"]
        lines += [f"{name:<{width}}  {_human(whole):>12}  {_human(here):>12}" for name, (whole, here) in self.counts.items()]
        rank_zero_info("Parameters (whole model = single-device count; rank 0 = its shards and stage):\n" + "\n".join(lines))
        total = self.counts["total"][0]
        trained = parameter_counts(pl_module, trainer.strategy, trainable=True)["total"][0]  # collective under pp
        if trained < total:  # a frozen base (LoRA): PEFT's print_trainable_parameters line, for the whole model
            rank_zero_info(f"trainable params: {trained:,} || all params: {total:,} || "
                           f"trainable%: {100 * trained / total:.4f}")
