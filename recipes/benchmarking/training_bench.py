"""End-to-end training steps of one GPT under several layouts, ours through the Trainer and torch-native TP + SP
(with FSDP2 over the data-parallel ranks), on the same model sizes and the same token batches.

Each row runs in processes of its own (gloo on CPU; NCCL on as many GPUs when present). Per row: tokens per second
over the timed steps, and, from one more step run under :class:`CollectiveCounter` (which costs time, so it is not
among the timed ones), the bytes each rank sent per collective kind and the host time spent inside collective calls.
That time is what a rank waits for communication where collectives block the host (gloo, and any ``wait``); on GPUs
NCCL kernels are queued and return at once, so it reads near zero there: use a profiler for device-side overlap.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_seqpar.parallel.collectives import CommunicationLog
from recipes.benchmarking.comm_counter import CollectiveCounter
from recipes.benchmarking.processes import run_on_processes, worker_device

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all_v", "send")


@dataclass(frozen=True)
class Row:
    """One layout: ``library`` is ``"lightning_seqpar"`` or ``"torch-native"``."""

    library: str
    tp: int
    pp: int = 1
    dp: int = 1
    zero: int = 0
    optimizer: str = "adamw"
    """``"muon"``: ``optim.name=muon`` (Muon over the layers' matrices, AdamW over the rest)"""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> str:
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        parts.append(f"tp {self.tp}")
        if self.dp > 1:
            parts.append(f"dp {self.dp}" + (f" zero {self.zero}" if self.library == "lightning_seqpar" else " FSDP2"))
        return " x ".join(parts) + (f", {self.optimizer}" if self.optimizer != "adamw" else "")


ROWS = (Row("lightning_seqpar", 2), Row("lightning_seqpar", 2, dp=2, zero=0), Row("lightning_seqpar", 2, dp=2, zero=1),
        Row("lightning_seqpar", 2, pp=2), Row("lightning_seqpar", 2, optimizer="muon"),
        Row("lightning_seqpar", 2, dp=2, optimizer="muon"), Row("lightning_seqpar", 2, dp=2, zero=1, optimizer="muon"),
        Row("lightning_seqpar", 2, pp=2, optimizer="muon"),
        Row("torch-native", 2), Row("torch-native", 2, dp=2))


@dataclass
class TrainingResult:
    """One row of the table (rank 0's view)."""

    library: str
    layout: str
    world: int
    tokens_per_s: float
    """global tokens (all data-parallel ranks) per second, median step"""
    step_ms: float
    comm_ms: float
    """host milliseconds inside collective calls in the counted step"""
    bytes_per_step: dict[str, int] = field(default_factory=dict)
    """bytes this rank sent per collective kind in one step (ring model; point-to-point: payload)"""


def _batches(cfg: dict[str, Any], dp: int, dp_rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches for every row: ``steps`` of ``[dp·b, s+1]`` tokens, this rank's ``b`` rows."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg["vocab_size"], (cfg["global_batch"], cfg["s"] + 1), generator=generator)
        mine = tokens.chunk(dp)[dp_rank]
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


class _Measure:
    """Step timing, then one counted step (for the Trainer: as a callback)."""

    def __init__(self, cfg: dict[str, Any], device: torch.device) -> None:
        self.cfg, self.device, self.times, self.counter = cfg, device, [], None
        self._start = 0.0
        self.exchanges: Optional[CommunicationLog] = None
        """the tensor-parallel and data-parallel groups' own log over the counted step (Muon's all_to_all_v, which
        the dispatch-level counter does not split by destination)"""

    def begin(self, step: int) -> None:
        if step == self.cfg["warmup"] + self.cfg["iters"]:
            self.counter = CollectiveCounter(2, timed=True)  # every group of every row has 2 ranks
            self.counter.__enter__()
        self._sync()
        self._start = time.perf_counter()

    def end(self, step: int) -> None:
        self._sync()
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        elif step >= self.cfg["warmup"]:
            self.times.append(time.perf_counter() - self._start)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def result(self, row: Row) -> TrainingResult:
        assert self.counter is not None
        step = statistics.median(self.times)
        log = self.counter.log
        sent = {kind: log.bytes_moved(kind) for kind in KINDS if kind not in ("send", "all_to_all_v")}
        sent["send"] = self.counter.sent_bytes
        sent["all_to_all_v"] = self.exchanges.bytes_moved("all_to_all_v") if self.exchanges is not None else 0
        return TrainingResult(row.library, row.layout, row.world, self.cfg["global_batch"] * self.cfg["s"] / step,
                              1e3 * step, 1e3 * self.counter.seconds, sent)


def _ours(row: Row, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    import lightning.pytorch as pl

    from lightning_seqpar import Layout
    from lightning_seqpar.lightning.strategy import SeqParallelStrategy
    from lightning_seqpar.models.gpt import GPTConfig
    from lightning_seqpar.models.module import GPTLightningModule

    measure = _Measure(cfg, device)

    class Callback(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["warmup"] + cfg["iters"]:  # the counted step
                measure.exchanges = CommunicationLog()
                for group in (trainer.strategy.mesh.group("tp"), trainer.strategy.mesh.data):
                    group.log = measure.exchanges
            measure.begin(batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            measure.end(batch_idx)
            for group in (trainer.strategy.mesh.group("tp"), trainer.strategy.mesh.data):
                group.log = None

    steps = cfg["warmup"] + cfg["iters"] + 1
    strategy = SeqParallelStrategy(tp=row.tp, pp=row.pp, layout=Layout(zero=row.zero))
    trainer = pl.Trainer(accelerator=device.type, devices=row.world, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Callback()],
                         precision=cfg["precision"])
    config = GPTConfig(block_size=cfg["s"], vocab_size=cfg["vocab_size"], n_layer=cfg["n_layer"],
                       n_head=cfg["n_head"], n_embd=cfg["n_embd"], dropout=0.0, bias=True)
    torch.manual_seed(0)
    module = GPTLightningModule(config, learning_rate=1e-4, optimizer=row.optimizer)
    trainer.fit(module, _Loader(cfg, row, steps))
    if trainer.global_rank == 0:
        (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(measure.result(row))))


class _Loader:
    """This data-parallel rank's share of the common batches (its rank is known once the process group exists)."""

    def __init__(self, cfg: dict[str, Any], row: Row, steps: int) -> None:
        self.cfg, self.row, self.steps = cfg, row, steps

    def __iter__(self):
        dp_rank = (dist.get_rank() // self.row.tp) % self.row.dp
        return iter(_batches(self.cfg, self.row.dp, dp_rank, self.steps))

    def __len__(self) -> int:
        return self.steps


def _native(row: Row, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recipes.benchmarking.native_gpt import NativeGPT, parallelize_native_gpt, sum_position_gradient

    mesh = init_device_mesh(device.type, (row.dp, row.tp), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    model = NativeGPT(cfg["vocab_size"], cfg["s"], cfg["n_layer"], cfg["n_embd"], cfg["n_head"]).to(device)
    model = parallelize_native_gpt(model, mesh["tensor"])
    if row.dp > 1:
        bf16 = cfg["precision"].startswith("bf16")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.h:
            fully_shard(block, mesh=mesh["data"], mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mesh=mesh["data"], mp_policy=policy, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    measure = _Measure(cfg, device)
    steps = cfg["warmup"] + cfg["iters"] + 1
    for step, (x, y) in enumerate(_batches(cfg, row.dp, mesh["data"].get_local_rank(), steps)):
        measure.begin(step)
        with torch.autocast(device.type, torch.bfloat16, enabled=cfg["precision"] == "bf16-mixed"):
            loss = model(x.to(device), y.to(device))
        loss.backward()
        sum_position_gradient(model, mesh["tensor"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measure.end(step)
    if dist.get_rank() == 0:
        (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(measure.result(row))))


def _worker(local_rank: int, row: Row, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    device = worker_device(local_rank, row.world, port)
    cuda = device.type == "cuda"
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(row.world),
                      LOCAL_WORLD_SIZE=str(row.world))
    if row.library == "lightning_seqpar":  # launched like torchrun: the strategy starts the process group
        _ours(row, cfg, device, out_dir)
        return
    dist.init_process_group("nccl" if cuda else "gloo", rank=local_rank, world_size=row.world)
    try:
        _native(row, cfg, device, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # done: gloo's threads abort a finished process now and then in interpreter teardown (SIGABRT)


def run_training_benchmark(cfg: dict[str, Any], rows: tuple[Row, ...] = ROWS,
                           only: Optional[list[str]] = None) -> list[TrainingResult]:
    """Run every row (each in fresh processes) and return rank 0's results, in order.

    ``cfg``: vocab_size, s, n_layer, n_head, n_embd, global_batch (sequences per step over all data-parallel ranks),
    precision ("32-true" | "bf16-mixed"), warmup, iters. ``only``: layouts to run (``Row.layout``), default all.

    Raises:
        ValueError: a global batch not divisible by the largest data-parallel size.
    """
    if any(cfg["global_batch"] % row.dp for row in rows):
        raise ValueError(f"global_batch={cfg['global_batch']} must be divisible by every row's dp.")
    results = []
    for row in rows:
        if only and f"{row.library}: {row.layout}" not in only and row.layout not in only:
            continue
        results.append(TrainingResult(**run_on_processes(_worker, row.world, row, cfg)))
    return results
