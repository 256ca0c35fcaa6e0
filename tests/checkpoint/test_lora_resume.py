"""A LoRA run's sharded checkpoint resumes under another layout (tp 2 → one process), its adapters and
their AdamW state resharded, on the loss curve of the uninterrupted one-process PEFT run; a checkpoint that lost
one tensor-parallel rank's file is refused before any weight is read."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import Recorder, build, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

GLOBAL_BATCH, EPOCH_STEPS = 4, 2
DATA = token_data(EPOCH_STEPS, GLOBAL_BATCH // 2)
MODEL = dict(labels=True, kv_heads=4, lora="all")


def _loader(dp: int, dp_rank: int) -> DataLoader:
    sampler = DistributedSampler(DATA, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    return DataLoader(DATA, batch_size=GLOBAL_BATCH // dp, sampler=sampler)


def _trainer(strategy, devices: int, epochs: int, callbacks) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )


def _run(rank, world, tp, pp, epochs, directory, resume):
    dp = world // (tp * pp)
    recorder = Recorder()
    callbacks = [recorder] + ([ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)] if directory else [])
    trainer = _trainer(SeqParallelStrategy(tp=tp, pp=pp), world, epochs, callbacks)
    trainer.fit(build("hf", **MODEL), _loader(dp, (rank // tp) % dp), ckpt_path=resume)
    return recorder.logged


@pytest.fixture(scope="module")
def reference():
    recorder = Recorder()
    _trainer("auto", 1, 2, [recorder]).fit(build("hf", **MODEL).double(), _loader(1, 0))
    return recorder.logged


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora_tp2")
    losses = run_distributed(_run, 2, 2, 1, 1, str(directory), None)[0]
    return losses, directory / "last.ckpt"


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("world, tp, pp", [(1, 1, 1)], ids=["tp2-to-one-process"])  # into pp: test_lora_checkpoint_base
def test_a_lora_checkpoint_resumes_under_another_layout_on_the_one_process_curve(saved, reference, world, tp, pp):
    first, checkpoint = saved
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, pp, 2, None, str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])


def test_a_checkpoint_missing_one_tensor_parallel_rank_is_refused(saved, tmp_path):
    import shutil

    _, checkpoint = saved
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, damaged)
    files = sorted(p for p in damaged.rglob("*") if p.is_file() and "1" in p.stem and p.suffix == ".distcp")
    assert files, sorted(p.name for p in damaged.rglob("*"))
    files[0].unlink()
    with pytest.raises(AssertionError) as refused:
        run_distributed(_run, 2, 2, 1, 2, None, str(damaged))
    assert f"{files[0].name}: missing" in str(refused.value) and "is not what was written" in str(refused.value)
