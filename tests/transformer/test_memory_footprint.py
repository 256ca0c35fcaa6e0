"""A rank's memory while the strategy parallelizes an eagerly built model: one model, not 1 + 1/t.

A ~300M-parameter reference GPT (1.2 GB in float32) built in the module's ``__init__``, then
``trainer.validate`` at tp 2. Measured: the growth of each process's peak resident memory, over the bytes
of the whole model.
"""

import gc

import pytest
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models import GPTConfig, GPTLightningModule
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import peak_resident_kib, resident_kib

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _validate_eager_model(rank, world_size):
    gc.collect()
    before = resident_kib()
    module = GPTLightningModule(GPTConfig(vocab_size=256, block_size=16, n_layer=24, n_head=16, n_embd=1024))
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    tokens = torch.randint(0, 256, (2, 16))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=world_size), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, DataLoader(TensorDataset(tokens, tokens), batch_size=2), verbose=False)
    peak = peak_resident_kib()
    return model_bytes, (peak - before) * 1024 / model_bytes


def test_an_eager_model_costs_one_model_per_rank_at_tp_2():
    for model_bytes, growth in run_distributed(_validate_eager_model, 2):
        assert model_bytes >= 300e6 * 4  # at least 300M float32 parameters
        print(f"peak growth: {growth:.3f} x the whole model")
        assert growth <= 1.1  # was 1.68 when every block's shards were made before any full block was freed
