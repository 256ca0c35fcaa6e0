"""ZeRO-1: each data-parallel rank holds its part of the optimizer state, and training is unchanged
(tp 2 x dp 2; float64, bf16-mixed, bf16-true). Parity with one process: test_parity / test_pipeline_parity."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.optim.distributed_optimizer import optimizer_state_bytes
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, loader, token_data

WIDE = (("n_embd", 64), ("n_layer", 2))


PRECISIONS = ("64-true", "bf16-mixed", "bf16-true")


def _fit(world_size, zero, precision="64-true"):
    trainer = pl.Trainer(strategy=SeqParallelStrategy(tp=2, zero=zero), accelerator="cpu", devices=world_size,
                         precision=precision, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(build("gpt", **dict(WIDE)), loader(token_data(2, 2)))
    optimizer = trainer.strategy.optimizers[0]
    largest = max(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
    return optimizer_state_bytes(optimizer), largest, trainer.strategy.full_state_dict()


def _both(rank, world_size):
    return {precision: (_fit(world_size, 0, precision), _fit(world_size, 1, precision)) for precision in PRECISIONS}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both, 4)  # tp 2 x dp 2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero1_trains_exactly_like_replicated_optimizer_state(runs, precision):
    for per_precision in runs:
        (_, _, replicated), (_, _, sharded) = per_precision[precision]
        assert replicated.keys() == sharded.keys()
        for key in replicated:  # the same update of each parameter, computed by its owner: bit for bit
            torch.testing.assert_close(sharded[key], replicated[key], rtol=0, atol=0, msg=key)


def test_zero1_optimizer_state_is_split_over_the_data_parallel_ranks(runs):
    tp = 2
    for tp_rank in range(tp):
        dp_ranks = [runs[tp_rank + tp * d]["64-true"] for d in range(2)]  # the same shards, different data-parallel ranks
        full = dp_ranks[0][0][0]
        assert all(r[0][0] == full for r in dp_ranks)  # zero=0: every replica holds all of it
        parts = [r[1][0] for r in dp_ranks]
        assert sum(parts) == full  # every parameter's state is held by exactly one data-parallel rank
        # Whole parameters are assigned greedily, largest first: off an exact half by at most one parameter's
        # state (AdamW: exp_avg and exp_avg_sq, each the parameter's size).
        largest_state = 2 * dp_ranks[0][1][1]
        assert max(parts) <= full / 2 + largest_state
        assert max(parts) < 0.6 * full
