"""Where a pipelined step's time goes: the executor's timeline tiles each step (every action timed once, the segments
summing to the step), and a zero-bubble schedule does the FLOPs of 1F1B (torch's FlopCounterMode over one step, all
ranks): what it adds on the clock is overhead, not work."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_seqpar.pipeline_parallel.timeline import KINDS, StepTimeline
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

SCHEDULES = ("1F1B", "ZB-H1", "ZB-V")
M = 4


def _step_of_each_schedule(rank, world):
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_seqpar import Layout, SeqParallelStrategy
    from lightning_seqpar.models.gpt import GPTConfig
    from lightning_seqpar.models.module import GPTLightningModule

    out = {}
    for schedule in SCHEDULES:
        timeline = StepTimeline()

        class Measure(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                trainer.strategy.pipeline.executor.timeline = timeline
                self.flops = FlopCounterMode(display=False).__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.flops.__exit__(None, None, None)
                out[schedule] = dict(segments=list(timeline.segments), steps=list(timeline.steps),
                                     flops=self.flops.get_total_flops())

        torch.manual_seed(0)
        data = torch.randint(0, 32, (4, 9))
        strategy = SeqParallelStrategy(tp=1, pp=2, layout=Layout(num_microbatches=M, schedule=schedule))
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, precision="64-true", callbacks=[Measure()])
        module = GPTLightningModule(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=8))
        trainer.fit(module, DataLoader([(row[:-1], row[1:]) for row in data], batch_size=4))
    return out


def test_every_action_is_timed_once_and_a_zero_bubble_step_does_1f1b_s_flops():
    per_rank = run_distributed(_step_of_each_schedule, 2)
    for rank, runs in enumerate(per_rank):
        for schedule, run in runs.items():
            segments, chunks = run["segments"], 2 if schedule == "ZB-V" else 1
            (step,) = run["steps"]
            assert math.isclose(sum(s.seconds for s in segments), step, rel_tol=1e-9, abs_tol=1e-12)
            assert all(s.seconds >= 0 for s in segments)
            for kind in ("F", "B", "W"):
                timed = sorted((s.chunk, s.microbatch) for s in segments if s.kind == kind)
                expected = [] if kind == "W" and schedule == "1F1B" else [
                    (c, i) for c in range(chunks) for i in range(M)]
                assert timed == expected, (rank, schedule, kind)
            assert {s.kind for s in segments} <= set(KINDS) and any(s.kind == "post" for s in segments)
    flops = {schedule: sum(runs[schedule]["flops"] for runs in per_rank) for schedule in SCHEDULES}
    assert flops["1F1B"] > 0 and flops["ZB-H1"] == flops["1F1B"] and flops["ZB-V"] == flops["1F1B"], flops
