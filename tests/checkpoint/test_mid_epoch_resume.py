"""A step-based run resumed from a mid-epoch checkpoint continues with the exact next batches."""

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


def _fit(world_size, corpus, max_steps, callbacks=(), ckpt_path=None):
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16), learning_rate=1e-2)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=2), precision="64-true",
                         max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[recorder, *callbacks],
                         enable_checkpointing=bool(callbacks))
    trainer.fit(module, datamodule=TextDataModule(corpus, block_size=8, batch_size=2, val_fraction=0.2),
                ckpt_path=ckpt_path)
    return recorder.losses


def _run(rank, world_size, directory):
    corpus = Path(directory) / "corpus.txt"
    if rank == 0:
        corpus.write_bytes(bytes(range(256)) * 2)  # 512 bytes: 51 training blocks → 12 steps of 2 × dp 2 per epoch
    torch.distributed.barrier()
    straight = _fit(world_size, str(corpus), 8)
    every_5 = ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1, filename="s{step}",
                              auto_insert_metric_name=False)
    first = _fit(world_size, str(corpus), 5, callbacks=[every_5])
    resumed = _fit(world_size, str(corpus), 8, ckpt_path=str(Path(directory) / "s5.ckpt"))
    return straight, first, resumed


def test_resuming_mid_epoch_continues_with_the_exact_next_batches(tmp_path):
    for straight, first, resumed in run_distributed(_run, 4, str(tmp_path)):  # tp 2 × dp 2
        assert len(straight) == 8 and first == straight[:5]
        assert resumed == straight[5:]  # steps 6..8 of epoch 0: the data position was restored, not restarted
