"""A run stopped by SIGTERM resumes exactly where it stopped: the same epoch, the next batch, and its first logged
step is the step after the last one logged (before: the checkpoint was written once training had ended, so Lightning
counted the epoch as finished; the resumed run started epoch 1 and logged every step one ahead), whether checkpoints
are written in the background every step or not."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_seqpar import CheckpointConfig, Preemption, SeqParallelStrategy
from lightning_seqpar.models.gpt import GPTConfig
from lightning_seqpar.models.module import GPTLightningModule

STEPS, SIGNAL_AT = 8, 3


class _Signal(pl.Callback):
    """SIGTERM's handler, as the signal would call it, after step ``SIGNAL_AT``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == SIGNAL_AT:
            next(c for c in trainer.callbacks if isinstance(c, Preemption))._on_signal(15, None)


def _logged(root, async_save, every, signal=False, resume=None):
    torch.manual_seed(0)
    rows = torch.randint(0, 32, (64, 9))
    train = StatefulDataLoader([(r[:-1], r[1:]) for r in rows], batch_size=2)  # resumes on the next batch
    val = DataLoader([(r[:-1], r[1:]) for r in rows[:4]], batch_size=2)
    callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, every_n_train_steps=every),
                 Preemption()] + ([_Signal()] if signal else [])
    strategy = SeqParallelStrategy(checkpointing=CheckpointConfig(async_save=async_save))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy,
                         max_steps=STEPS, logger=CSVLogger(root, name="logs"), log_every_n_steps=1,
                         val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPTLightningModule(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)), train, val,
                ckpt_path=resume)
    with open(next(root.rglob("metrics.csv"))) as f:
        return [(int(r["epoch"]), int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f) if r["train/loss"]]


@pytest.mark.parametrize("async_save, every", [(True, 1), (False, 1000)], ids=["async-saves-every-step", "no-saves"])
def test_a_preempted_run_resumes_in_its_epoch_and_logs_each_step_at_its_own_number(tmp_path, async_save, every):
    whole = _logged(tmp_path / "whole", async_save, every)
    first = _logged(tmp_path / "first", async_save, every, signal=True)
    resumed = _logged(tmp_path / "resumed", async_save, every,
                      resume=str(tmp_path / "first" / "checkpoints" / "last.ckpt"))
    assert [s for _, s, _ in whole] == list(range(STEPS))
    assert first == whole[:SIGNAL_AT + 2]  # stopped after the step following the signal
    assert [(e, s) for e, s, _ in resumed] == [(e, s) for e, s, _ in whole[SIGNAL_AT + 2:]]
    assert [loss for *_, loss in resumed] == pytest.approx([loss for *_, loss in whole[SIGNAL_AT + 2:]], rel=1e-6)
