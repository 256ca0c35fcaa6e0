"""Sharded checkpoints: written by every rank, resumed under another layout on the uninterrupted curve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint import consolidate, is_sharded_checkpoint
from tests.helpers.distributed import run_distributed
from tests.helpers.models import Recorder, build, token_data

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, EPOCH_STEPS = 4, 2
DATA = token_data(EPOCH_STEPS, GLOBAL_BATCH // 2)  # EPOCH_STEPS · GLOBAL_BATCH samples


def _loader(dp: int, dp_rank: int) -> DataLoader:
    # The same global batch at every layout: the d ranks' batches together are the one process's batch.
    sampler = DistributedSampler(DATA, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    return DataLoader(DATA, batch_size=GLOBAL_BATCH // dp, sampler=sampler)


def _trainer(strategy, devices: int, epochs: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=[*callbacks], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
    )


def _run(rank, world, tp, pp, zero, epochs, directory, resume):
    """Train the seeded tiny GPT under (tp, pp, dp = world/(tp·pp), zero); save last.ckpt; return logged losses."""
    dp = world // (tp * pp)
    recorder = Recorder()
    callbacks = [recorder]
    if directory:
        callbacks.append(ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0))
    trainer = _trainer(SeqParallelStrategy(tp=tp, pp=pp, zero=zero), world, epochs, callbacks)
    trainer.fit(build("gpt"), _loader(dp, (rank // tp) % dp), ckpt_path=resume)
    return recorder.logged


def _reference(epochs: int):
    """The uninterrupted one-process run, Lightning without our strategy: logged losses and final weights."""
    recorder = Recorder()
    trainer = _trainer("auto", 1, epochs, [recorder])
    module = build("gpt")
    trainer.fit(module, _loader(1, 0))
    return recorder.logged, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    return _reference(2)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Epoch 1 of training under three layouts, each checkpointed: {name: (losses, last.ckpt)}."""
    out = {}
    for name, world, tp, pp, zero in [("tp2", 2, 2, 1, 0), ("pp2xtp2", 4, 2, 2, 0), ("tp2xdp2_zero1", 4, 2, 1, 1)]:
        directory = tmp_path_factory.mktemp(name)
        losses = run_distributed(_run, world, tp, pp, zero, 1, str(directory), None)[0]
        out[name] = (losses, directory / "last.ckpt")
    return out


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("source, world, tp, pp, zero", [
    ("tp2", 4, 4, 1, 0),              # tp2 -> tp4 (vocabulary padding 13 -> 16 at tp4)
    ("tp2", 4, 2, 2, 0),              # tp2 -> pp2 x tp2
    ("pp2xtp2", 2, 2, 1, 0),          # pp2 x tp2 -> tp2
    ("tp2xdp2_zero1", 2, 1, 2, 0),    # tp2 x dp2 (ZeRO-1) -> pp2
    ("tp2", 1, 1, 1, 0),              # tp2 -> one process
    ("tp2", 4, 1, 1, 1),              # tp2 -> dp4 (ZeRO-1)
])
def test_resume_under_another_layout_continues_the_one_process_curve(saved, reference, source, world, tp, pp, zero):
    first, checkpoint = saved[source]
    assert is_sharded_checkpoint(checkpoint)
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, pp, zero, 2, "", str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])


def test_consolidated_checkpoint_loads_into_the_plain_model(saved, tmp_path):
    _, after_one_epoch = _reference(1)
    for name in ("tp2", "pp2xtp2"):
        state = consolidate(saved[name][1])
        model = build("gpt").double()
        model.load_state_dict(state)  # strict: same keys, single-device shapes, no vocabulary padding
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, after_one_epoch[key], rtol=1e-9, atol=1e-12, msg=key)
    out = tmp_path / "model.pt"
    result = subprocess.run([sys.executable, "-m", "lightning_seqpar.checkpoint", "consolidate",
                             str(saved["tp2xdp2_zero1"][1]), str(out)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    model = build("gpt").double()
    model.load_state_dict(torch.load(out, weights_only=True))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, after_one_epoch[key], rtol=1e-9, atol=1e-12, msg=key)
