"""Pipeline-schedule benchmark: 1F1B against ZB-H1 and ZB-V (and any other schedule) on one GPT, in one run.

    python recipes/benchmark_pipeline.py                      # on CPU (gloo), or on GPUs (NCCL) when there are enough
    python recipes/benchmark_pipeline.py pp=[4] num_microbatches=16

Prints one table per run (the bubble of each executed trace under F = B = W and with B heavier than W, the peak
activation bytes per pipeline rank, sends and tensor-parallel collectives per step, tokens/s) and writes it as
markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from recipes.benchmarking.pipeline_bench import PipelineResult, PipelineRow, run_pipeline_benchmark  # noqa: E402
from recipes.benchmarking.report import print_table, settings_and_out, write_table  # noqa: E402
from lightning_seqpar.pipeline_parallel.timeline import KINDS  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["schedule", "pp", "bubble F=B=W", "bubble B-heavy", "peak KiB per rank", "sends/step", "tp collectives",
           "GFLOP/step", "tokens/s", "step ms"]
BREAKDOWN = ["schedule", "pp rank", *KINDS, "sum ms"]


def rows(results: list[PipelineResult]) -> list[list[str]]:
    return [[r.schedule, str(r.pp), f"{r.bubble_equal:.1%}", f"{r.bubble_b_heavy:.1%}",
             " / ".join(f"{b / 1024:.0f}" for b in r.peak_bytes), str(r.transfers), str(r.tensor_collectives),
             f"{r.flops / 1e9:.3f}", f"{r.tokens_per_s:.0f}", f"{r.step_ms:.1f}"] for r in results]


def breakdown_rows(results: list[PipelineResult]) -> list[list[str]]:
    """Host milliseconds per step of each pipeline rank by segment (the executor's timeline)."""
    return [[f"{r.schedule} pp {r.pp}", str(rank), *(f"{ms[kind]:.1f}" for kind in KINDS), f"{sum(ms.values()):.1f}"]
            for r in results for rank, ms in enumerate(r.breakdown)]


@hydra.main(config_path=CONF_DIR, config_name="benchmark_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    settings, out = settings_and_out(cfg)
    layout = [PipelineRow(schedule, pp, cfg.tp) for pp in cfg.pp for schedule in cfg.schedules]
    results = run_pipeline_benchmark(settings, layout)
    title = (f"Pipeline schedules, GPT L={cfg.n_layer} h={cfg.n_embd} v={cfg.vocab_size}, {cfg.global_batch} x "
             f"{cfg.s} tokens per step in {cfg.num_microbatches} micro-batches, {cfg.precision} (median of "
             f"{cfg.iters}; trace, bytes and counts from the first step)")
    body = rows(results)
    console = Console(width=180)
    print_table(title, COLUMNS, body, ("schedule",), console)
    written = write_table(out, "benchmark_pipeline", title, COLUMNS, body)
    split = breakdown_rows(results)
    where = "Host ms per step by segment (F, B, W: the actions; post/wait: transfers; other: the executor between them)"
    print_table(where, BREAKDOWN, split, ("schedule",), console)
    written += write_table(out, "benchmark_pipeline_actions", where, BREAKDOWN, split)
    console.print(f"wrote {', '.join(map(str, written))}")


if __name__ == "__main__":
    main()
