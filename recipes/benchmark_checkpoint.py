"""Checkpoint benchmark: sharded (every rank writes its shards) vs full (gathered, rank 0 writes) on one model.

    python recipes/benchmark_checkpoint.py                       # tp 2 on 2 CPU processes, a 124M-parameter GPT
    python recipes/benchmark_checkpoint.py --tp 2 --devices 4 --n-embd 1024 --n-layer 12

Trains one step (so AdamW's state exists), then saves and loads each format a few times and prints, per
format: save and load seconds (median over the repeats, wall time of the slowest rank), the part of a sharded
load spent checking its files against the manifest, bytes written by each rank, and the host memory rank 0
needed to save (peak resident growth).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.manifest import verify_on_every_rank
from lightning_seqpar.lightning.config import CheckpointConfig
from lightning_seqpar.models import GPTConfig, GPTLightningModule


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _bytes_per_rank(path: Path, world: int) -> list[int]:
    if path.is_file():
        return [path.stat().st_size] + [0] * (world - 1)
    return [sum(f.stat().st_size for f in path.glob(f"__{r}_*.distcp")) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=50304, block_size=64, n_layer=args.n_layer, n_head=12, n_embd=args.n_embd)
    module = GPTLightningModule(config)
    strategy = SeqParallelStrategy(tp=args.tp)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = TensorDataset(torch.randint(0, 50304, (8, 64)), torch.randint(0, 50304, (8, 64)))
    trainer.fit(module, DataLoader(data, batch_size=2))
    out = Path(args.out or tempfile.mkdtemp())
    rows = []
    for fmt in ("sharded", "full"):
        strategy.checkpointer.config = CheckpointConfig(format=fmt)
        path = out / f"{fmt}.ckpt"
        before = _peak_rss()
        saves = [_timed(lambda: trainer.save_checkpoint(path)) for _ in range(args.repeats)]
        grown = _peak_rss() - before

        def load() -> None:
            checkpoint = strategy.load_checkpoint(path)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)

        loads = [_timed(load) for _ in range(args.repeats)]
        # The manifest check of a sharded load (also the cost each rank adds to a save, hashing what it wrote).
        checks = [_timed(lambda: verify_on_every_rank(path)) for _ in range(args.repeats)] if fmt == "sharded" else [0.0]
        rows.append((fmt, statistics.median(saves), statistics.median(loads), statistics.median(checks),
                     _bytes_per_rank(path, trainer.world_size), grown))
    if trainer.is_global_zero:
        params = sum(p.numel() for p in GPTLightningModule(config).parameters())
        table = Table(title=f"GPT {params / 1e6:.0f}M parameters, tp={args.tp}, {args.devices} processes, fp32 + AdamW")
        for column in ("format", "save s", "load s", "of which verification s", "bytes written per rank (MiB)",
                       "rank 0 peak RSS growth on save (MiB)"):
            table.add_column(column)
        for fmt, save, load, check, written, grown in rows:
            table.add_row(fmt, f"{save:.2f}", f"{load:.2f}", f"{check:.2f}" if fmt == "sharded" else "-",
                          " / ".join(f"{b / 2**20:.0f}" for b in written), f"{grown / 2**20:.0f}")
        Console().print(table)


if __name__ == "__main__":
    main()
