"""A step-based run resumed from a mid-epoch checkpoint continues with the exact next batches, at the same
data-parallel size and at another (the saved position is the global sample index), on the uninterrupted curve."""

from pathlib import Path

import pytest
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.data import TextDataModule
from lightning_seqpar.models import GPTConfig, GPTLightningModule
from tests.helpers.distributed import run_distributed
from tests.helpers.models import Recorder

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


GLOBAL_BATCH = 4


def _fit(world_size, corpus, max_steps, callbacks=(), ckpt_path=None, tp=2):
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16), learning_rate=1e-2)
    recorder = Recorder()
    dp = world_size // tp
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=tp), precision="64-true",
                         max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[recorder, *callbacks],
                         enable_checkpointing=bool(callbacks))
    trainer.fit(module, datamodule=TextDataModule(corpus, block_size=8, batch_size=GLOBAL_BATCH // dp,
                                                  val_fraction=0.2), ckpt_path=ckpt_path)
    return recorder.logged  # synced over the data-parallel ranks: the global batch's mean


def _save_at_5(directory, world_size, tp):
    every_5 = ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1, filename="s{step}",
                              auto_insert_metric_name=False)
    return _fit(world_size, str(Path(directory).parent / "corpus.txt"), 5, callbacks=[every_5], tp=tp)


def _corpus(rank, directory):
    corpus = Path(directory) / "corpus.txt"
    if rank == 0:
        corpus.write_bytes(bytes(range(256)) * 2)  # 512 bytes: 51 training blocks → 12 steps of 4 per epoch
    torch.distributed.barrier()
    return str(corpus)


def _world_of_2(rank, world_size, directory):
    """dp 1 (tp 2): the uninterrupted run and a checkpoint at step 5; that checkpoint resumed at dp 2 (tp 1)."""
    corpus = _corpus(rank, directory)
    straight = _fit(world_size, corpus, 8)
    _save_at_5(str(Path(directory) / "dp1"), world_size, tp=2)
    at_dp2 = _fit(world_size, corpus, 8, ckpt_path=str(Path(directory) / "dp1" / "s5.ckpt"), tp=1)
    return straight, at_dp2


def _dead_writers_temporary(folder):
    """``.s6.ckpt.tmp-PID`` of a writer that no longer runs: what a save killed mid-write leaves."""
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    temporary = Path(folder) / f".s6.ckpt.tmp-{finished.pid}"
    temporary.mkdir()
    (temporary / "__0_0.distcp").write_bytes(b"half")
    return temporary


def _world_of_4(rank, world_size, directory):
    """dp 2 (tp 2): the uninterrupted run, a checkpoint at step 5 resumed at dp 2; and at dp 4 (tp 1). The resumes
    write nowhere near the folder they read, whose leftovers of a killed save they clean up."""
    corpus = _corpus(rank, directory)
    straight = _fit(world_size, corpus, 8)
    first = _save_at_5(str(Path(directory) / "dp2"), world_size, tp=2)
    leftover = _dead_writers_temporary(Path(directory) / "dp2") if rank == 0 else None
    same = _fit(world_size, corpus, 8, ckpt_path=str(Path(directory) / "dp2" / "s5.ckpt"))
    assert leftover is None or not leftover.exists()
    at_dp4 = _fit(world_size, corpus, 8, ckpt_path=str(Path(directory) / "dp2" / "s5.ckpt"), tp=1)
    return straight, first, same, at_dp4


def _dp2_resumed_at_dp1(rank, world_size, directory):
    return _fit(world_size, _corpus(rank, directory), 8, ckpt_path=str(Path(directory) / "dp2" / "s5.ckpt"))


def test_resuming_mid_epoch_continues_with_the_exact_next_batches_at_any_data_parallel_size(tmp_path):
    straight, at_dp2 = run_distributed(_world_of_2, 2, str(tmp_path))[0]
    assert len(straight) == 8
    for straight_dp2, first, same, at_dp4 in run_distributed(_world_of_4, 4, str(tmp_path)):  # tp 2 × dp 2
        assert first == straight_dp2[:5]
        assert same == straight_dp2[5:]  # steps 6..8 of epoch 0: the data position was restored, not restarted
        # The same global batches at dp 1 and dp 2: one curve, to float64 rounding.
        assert straight_dp2 == pytest.approx(straight, rel=1e-10)
        assert at_dp4 == pytest.approx(straight[5:], rel=1e-10)  # dp 2 → 4 (tp 2 → 1)
    assert at_dp2 == pytest.approx(straight[5:], rel=1e-10)  # dp 1 → 2 (tp 2 → 1)
    at_dp1 = run_distributed(_dp2_resumed_at_dp1, 2, str(tmp_path))[0]
    assert at_dp1 == pytest.approx(straight[5:], rel=1e-10)  # dp 2 → 1
