"""Run the same training under SeqParallelStrategy inside already-spawned processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import lightning.pytorch as pl

from lightning_seqpar import SelectiveRecompute, SeqParallelStrategy
from tests.helpers.models import Recorder, build, loader, token_data

STEPS = 3


@dataclass(frozen=True)
class Case:
    kind: str  # "gpt" or "encoder"
    tp: int
    sequence_parallel: bool = True
    recompute: Optional[str] = None  # None, "selective", "full"
    model: tuple = field(default_factory=tuple)  # extra model kwargs as (key, value) pairs
    trainer: tuple = field(default_factory=tuple)  # extra Trainer kwargs as (key, value) pairs
    strategy: tuple = field(default_factory=tuple)
    pp: int = 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)


def fit(case: Case, world_size: int, steps: int = STEPS, callbacks=(), epoch_steps=None, ckpt_path=None,
        **overrides) -> Recorder:
    """Train ``case`` for ``steps`` optimizer steps (epochs of ``epoch_steps``); return what this rank recorded."""
    module = build(case.kind, **dict(case.model))
    recorder = Recorder()
    extra = list(callbacks)
    if case.recompute:
        extra.append(SelectiveRecompute(granularity=case.recompute))
    trainer_kwargs = dict(
        accelerator="cpu", devices=world_size, precision="64-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer_kwargs.update(dict(case.trainer))
    trainer_kwargs.update(overrides)
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    trainer = pl.Trainer(
        strategy=SeqParallelStrategy(tp=case.tp, pp=case.pp, sequence_parallel=case.sequence_parallel, **dict(case.strategy)),
        callbacks=[recorder, *extra], **trainer_kwargs,
    )
    data = token_data((epoch_steps or steps) * accumulate, case.dp(world_size))
    trainer.fit(module, loader(data), ckpt_path=ckpt_path)
    return recorder
