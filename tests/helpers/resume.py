"""The resume harness: epochs of the same global batches at every layout, saved and resumed, against one process.

Every data-parallel rank reads its part of the one global batch of each step (a ``DistributedSampler`` over
:data:`DATA` seeded alike), so any layout's logged losses are the one-process run's; a run saves ``last.ckpt`` at its
end, and a later run resumes from it under another layout and continues the same curve.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.models import Recorder, token_data

GLOBAL_BATCH, EPOCH_STEPS = 4, 2
DATA = token_data(EPOCH_STEPS, GLOBAL_BATCH // 2)  # EPOCH_STEPS · GLOBAL_BATCH samples


def epoch_loader(dp: int, dp_rank: int) -> DataLoader:
    """Data-parallel rank ``dp_rank``'s part of every global batch of :data:`DATA`."""
    sampler = DistributedSampler(DATA, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    return DataLoader(DATA, batch_size=GLOBAL_BATCH // dp, sampler=sampler)


def epoch_trainer(strategy: Any, devices: int, epochs: int, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    """A float64 trainer of ``epochs`` epochs that checkpoints only when given a ``ModelCheckpoint``."""
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=[*callbacks],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )


def train_epochs(rank: int, world: int, strategy: Any, model: nn.Module, epochs: int, directory: Optional[str] = None,
                 resume: Optional[str] = None) -> list[float]:
    """Train ``model`` under ``strategy`` (a ``SeqParallelStrategy``) on ``world`` processes for ``epochs`` epochs,
    saving ``last.ckpt`` in ``directory`` and resuming from ``resume`` when given; this rank's logged losses."""
    dp = world // (strategy.tp * strategy.cp * strategy.pp)
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if directory:
        callbacks.append(ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0))
    epoch_trainer(strategy, world, epochs, callbacks).fit(
        model, epoch_loader(dp, (rank // (strategy.tp * strategy.cp)) % dp), ckpt_path=resume)
    return recorder.logged


def reference_epochs(model: nn.Module, epochs: int) -> list[float]:
    """The uninterrupted one-process run (Lightning without the strategy): its logged losses; ``model`` is trained in
    place."""
    recorder = Recorder()
    epoch_trainer("auto", 1, epochs, [recorder]).fit(model, epoch_loader(1, 0))
    return recorder.logged
