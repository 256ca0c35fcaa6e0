"""A sharded checkpoint written under context parallelism resumes at another cp size (and from tp into cp), its
weights and AdamW state resharded, on the loss curve of the uninterrupted one-process run (a Hugging Face Llama,
float64, ``model(input_ids=x, labels=x)``)."""

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


def _loader(dp: int, dp_rank: int) -> DataLoader:
    sampler = DistributedSampler(DATA, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
    return DataLoader(DATA, batch_size=GLOBAL_BATCH // dp, sampler=sampler)


def _trainer(strategy, devices: int, epochs: int, callbacks) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
    )


def _run(rank, world, tp, cp, pp, epochs, directory, resume):
    dp = world // (tp * cp * pp)
    recorder = Recorder()
    callbacks = [recorder] + ([ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)] if directory else [])
    trainer = _trainer(SeqParallelStrategy(tp=tp, cp=cp, pp=pp), world, epochs, callbacks)
    trainer.fit(build("hf", labels=True, kv_heads=4), _loader(dp, (rank // (tp * cp)) % dp), ckpt_path=resume)
    return recorder.logged


def _reference():
    recorder = Recorder()
    trainer = _trainer("auto", 1, 2, [recorder])
    trainer.fit(build("hf", labels=True, kv_heads=4).double(), _loader(1, 0))
    return recorder.logged


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Epoch 1 under each saving layout, checkpointed: {name: (losses, last.ckpt)}."""
    out = {}
    for name, world, tp, cp in [("cp2", 2, 1, 2), ("tp2xcp2", 4, 2, 2), ("tp2", 2, 2, 1)]:
        directory = tmp_path_factory.mktemp(name)
        losses = run_distributed(_run, world, tp, cp, 1, 1, str(directory), None)[0]
        out[name] = (losses, directory / "last.ckpt")
    return out


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("source, world, tp, cp, pp", [
    ("cp2", 1, 1, 1, 1),        # cp 2 -> one process
    ("cp2", 4, 1, 4, 1),        # cp 2 -> cp 4
    ("tp2xcp2", 4, 4, 1, 1),    # tp 2 x cp 2 -> tp 4
    ("tp2xcp2", 4, 1, 2, 2),    # tp 2 x cp 2 -> pp 2 x cp 2
    ("tp2", 4, 2, 2, 1),        # tp 2 -> tp 2 x cp 2
])
def test_resume_at_another_context_parallel_size_continues_the_one_process_curve(saved, reference, source, world, tp,
                                                                                 cp, pp):
    first, checkpoint = saved[source]
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, cp, pp, 2, "", str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])
