"""Pipeline schedules side by side on one GPT: each schedule's executed trace turned into a bubble by a fixed cost
model, the peak activation bytes each pipeline rank held, the transfers and tensor-parallel collectives per step,
and tokens/s (gloo on CPU, NCCL on GPUs).

The bubble is the trace's (the actions each rank ran, in their order, recorded by the executor), priced with
``F = B = W`` and with a B heavier than W (:data:`B_HEAVY_COSTS`); the bytes are the layer stack's live forward storages after each
action (:class:`~lightning_seqpar.memory.tracker.LiveActivationTracker`); the collectives are counted on the groups.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from recipes.benchmarking.processes import run_on_processes, worker_device

B_HEAVY_COSTS = (1.0, 1.2, 0.8)
"""F : B : W per chunk when B outweighs W: core attention's backward has no weight gradient, so B carries it (the
backward still twice the forward, Korthikanti et al. Eq. 7). An assumed ratio, beside F = B = W."""


@dataclass(frozen=True)
class PipelineRow:
    """One schedule at one pipeline size."""

    schedule: str
    pp: int
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.tp


@dataclass
class PipelineResult:
    """What one row measured (its step: median over the timed steps; the trace and bytes: the first step)."""

    schedule: str
    pp: int
    tp: int
    bubble_equal: float
    """idle fraction of the trace with F = B = W"""
    bubble_b_heavy: float
    """idle fraction of the trace with :data:`B_HEAVY_COSTS`"""
    peak_bytes: list[int] = field(default_factory=list)
    """per pipeline rank: the most bytes of the layer stack's forward storages alive after an action"""
    transfers: int = 0
    """point-to-point sends per step, all ranks"""
    tensor_collectives: int = 0
    """tensor-parallel collectives per step, summed over the first tp rank of every stage (ZB-V puts other layers on
    a rank than 1F1B: per rank they differ, the sum is the model's)"""
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    flops: float = 0.0
    """floating-point operations of the first step, all ranks (torch's ``FlopCounterMode``: matmuls and attention)"""
    breakdown: list[dict[str, float]] = field(default_factory=list)
    """per pipeline rank: host milliseconds per step by segment kind (:data:`~lightning_seqpar.pipeline_parallel.
    timeline.KINDS`), the mean over the timed steps"""


def _fit(row: PipelineRow, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    import lightning.pytorch as pl

    from lightning_seqpar import Layout
    from lightning_seqpar.lightning.strategy import SeqParallelStrategy
    from lightning_seqpar.memory.tracker import LiveActivationTracker
    from lightning_seqpar.models.gpt import GPTConfig
    from lightning_seqpar.models.module import GPTLightningModule
    from lightning_seqpar.parallel.collectives import CommunicationLog
    from lightning_seqpar.pipeline_parallel.schedules import splits_backward, stage_placement_of, trace_bubble_fraction

    from torch.utils.flop_counter import FlopCounterMode

    from lightning_seqpar.pipeline_parallel.timeline import StepTimeline

    record: dict[str, Any] = {"trace": [], "peak": 0, "times": [], "sends": 0, "collectives": 0, "flops": 0,
                              "breakdown": {}}
    timeline = StepTimeline()

    class Measure(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            executor = trainer.strategy.pipeline.executor
            if batch_idx == 0:  # the trace, the bytes and the FLOPs of the first step
                self.flops = FlopCounterMode(display=False).__enter__()
                self.tracker = LiveActivationTracker(pl_module).__enter__()
                executor.timeline = timeline
                executor.observers.append(self.observe)
                self.group = trainer.strategy.mesh.tensor
                self.group.log = CommunicationLog()  # the group records each collective it runs
            self.start = time.perf_counter()

        def observe(self, action, in_flight):
            record["trace"].append(action)
            record["peak"] = max(record["peak"], self.tracker.live_bytes(cfg["layers"]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device.type == "cuda":
                torch.cuda.synchronize()
            record["times"].append(time.perf_counter() - self.start)
            if batch_idx == cfg["warmup"]:  # the steps timed from here on
                timeline.clear()
            if batch_idx == 0:
                self.tracker.__exit__(None, None, None)
                self.flops.__exit__(None, None, None)
                record["flops"] = self.flops.get_total_flops()
                trainer.strategy.pipeline.executor.observers.clear()
                record["collectives"] = len(self.group.log.records) if self.group.size > 1 else 0
                self.group.log = None
                program = trainer.strategy.pipeline.executor._programs
                record["sends"] = sum(1 for steps in program.values() for step in steps
                                      for t in getattr(step, "transfers", ()) if t.send and not t.header)

    strategy = SeqParallelStrategy(tp=row.tp, pp=row.pp, layout=Layout(num_microbatches=cfg["num_microbatches"],
                                                                      schedule=row.schedule))
    steps = cfg["warmup"] + cfg["iters"] + 1
    trainer = pl.Trainer(accelerator=device.type, devices=row.world, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Measure()],
                         precision=cfg["precision"])
    config = GPTConfig(block_size=cfg["s"], vocab_size=cfg["vocab_size"], n_layer=cfg["n_layer"],
                       n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=0.0, bias=True)
    torch.manual_seed(0)
    module = GPTLightningModule(config, learning_rate=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (steps * cfg["global_batch"], cfg["s"]), generator=g)
    trainer.fit(module, DataLoader(TensorDataset(tokens, tokens), batch_size=cfg["global_batch"]))
    record["breakdown"] = {kind: 1000 * seconds / max(1, len(timeline.steps))
                           for kind, seconds in timeline.totals().items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if trainer.global_rank != 0:
        return
    pipeline_ranks = [gathered[r * row.tp] for r in range(row.pp)]  # the first tp rank of each stage
    traces = [rank["trace"] for rank in pipeline_ranks]
    pipeline = strategy.layout.pipeline
    split = splits_backward(pipeline.schedule)
    # (ZB-V: two chunks per rank in a V, each action half a stage's work: the same costs per chunk)
    placed = dict(v=pipeline.virtual_stages, split=split, placement=stage_placement_of(pipeline.schedule))
    step = statistics.median(record["times"][cfg["warmup"] + 1:])
    result = PipelineResult(
        row.schedule, row.pp, row.tp, trace_bubble_fraction(traces, **placed),
        trace_bubble_fraction(traces, costs=B_HEAVY_COSTS, **placed), [rank["peak"] for rank in pipeline_ranks],
        sum(rank["sends"] for rank in pipeline_ranks), sum(rank["collectives"] for rank in pipeline_ranks),
        cfg["global_batch"] * cfg["s"] / step, 1000 * step, float(sum(rank["flops"] for rank in gathered)),
        [rank["breakdown"] for rank in pipeline_ranks])
    (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(result)))


def _worker(local_rank: int, row: PipelineRow, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    device = worker_device(local_rank, row.world, port)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(row.world),
                      LOCAL_WORLD_SIZE=str(row.world))
    _fit(row, cfg, device, out_dir)
    os._exit(0)  # done: gloo's threads abort a finished process now and then in interpreter teardown (SIGABRT)


def run_pipeline_benchmark(cfg: dict[str, Any], rows: list[PipelineRow]) -> list[PipelineResult]:
    """Each row in fresh processes; rank 0's results, in order. ``cfg``: vocab_size, s, n_layer, n_head, n_embd,
    global_batch, num_microbatches, precision, warmup, iters, layers (the layer stack's module path)."""
    return [PipelineResult(**run_on_processes(_worker, row.world, row, cfg)) for row in rows]
