"""Training-step benchmark: one GPT, the same batches, under our layouts and torch-native TP + SP (+ FSDP2), in one run.

    python recipes/benchmark_training.py                      # on CPU (gloo), or on GPUs (NCCL) when there are 4
    python recipes/benchmark_training.py n_embd=512 precision=bf16-mixed

Prints one table (tokens/s, time inside communication calls, bytes sent per step per collective kind) and writes it
as markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from recipes.benchmarking.report import publish, settings_and_out  # noqa: E402
from recipes.benchmarking.training_bench import KINDS, TrainingResult, run_training_benchmark  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["library", "layout", "processes", "tokens/s", "step ms", "comm ms"] + [f"{k} KiB" for k in KINDS]


def rows(results: list[TrainingResult]) -> list[list[str]]:
    return [[r.library, r.layout, str(r.world), f"{r.tokens_per_s:.0f}", f"{r.step_ms:.1f}", f"{r.comm_ms:.1f}"]
            + [f"{r.bytes_per_step.get(k, 0) / 1024:.0f}" for k in KINDS] for r in results]


@hydra.main(config_path=CONF_DIR, config_name="benchmark_training", version_base="1.3")
def main(cfg: DictConfig) -> None:
    settings, out = settings_and_out(cfg)
    only = settings.pop("only")
    results = run_training_benchmark(settings, only=only)
    title = (f"Training step, GPT L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} v={cfg.vocab_size}, "
             f"{cfg.global_batch} x {cfg.s} tokens per step, {cfg.precision} (median of {cfg.iters}; bytes and comm "
             f"time from one more, counted step; rank 0)")
    body = rows(results)
    publish(out, "benchmark_training", title, COLUMNS, body, ("library", "layout"))

if __name__ == "__main__":
    main()
