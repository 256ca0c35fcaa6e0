"""Context-parallel benchmark: tp 4 against tp 2 × cp 2 (ring and all-to-all) on 4 processes, in one run.

    python recipes/benchmark_context_parallel.py                 # on CPU (gloo), or on 4 GPUs (NCCL)
    python recipes/benchmark_context_parallel.py s=4096 budget_mib=256 attention=sdpa

Prints one table (tokens/s, bytes kept for backward per rank, bytes sent per step by kind, the longest sequence
within the per-rank activation budget) and writes it as markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from lightning_seqpar.extras import require_extra  # noqa: E402
from recipes.benchmarking.context_bench import ContextResult, run_context_benchmark  # noqa: E402
from recipes.benchmarking.report import publish, settings_and_out  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "ring_send", "all_to_all")
COLUMNS = ["layout", "tokens/s", "kept MiB/rank"] + [f"{k} KiB" for k in KINDS] + ["longest s in budget"]


def rows(results: list[ContextResult]) -> list[list[str]]:
    return [[r.layout, f"{r.tokens_per_s:.0f}", f"{r.kept_mib:.1f}"] + [f"{r.sent_kib.get(k, 0):.0f}" for k in KINDS]
            + [str(r.longest_s) if r.longest_s else "none"] for r in results]


@hydra.main(config_path=CONF_DIR, config_name="benchmark_context_parallel", version_base="1.3")
def main(cfg: DictConfig) -> None:
    require_extra("hf", "recipes/benchmark_context_parallel.py (a Hugging Face Llama)")  # said before any process starts
    settings, out = settings_and_out(cfg)
    results = run_context_benchmark(settings)
    title = (f"Llama L={cfg.layers} h={cfg.hidden} a={cfg.heads} a_kv={cfg.kv_heads} v={cfg.vocab_size}, {cfg.b} x "
             f"{cfg.s} tokens per step, {cfg.attention} attention, float32, 4 processes (median of {cfg.iters}; kept "
             f"bytes and traffic of one more forward/backward; longest s doubling from {cfg.s_min} within "
             f"{cfg.budget_mib} MiB kept per rank; rank 0)")
    body = rows(results)
    publish(out, "benchmark_context_parallel", title, COLUMNS, body, ("layout",))


if __name__ == "__main__":
    main()
