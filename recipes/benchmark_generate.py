"""Generation benchmark: a Qwen3-MoE generating in its training layout (tp 1 and 2, pp 2, tp 2 × ep 2) beside
transformers' ``generate`` in one process, on the same model and prompts.

    python recipes/benchmark_generate.py              # on CPU (gloo), or on GPUs (NCCL)
    python recipes/benchmark_generate.py s=256 n=64

Prints one table (prefill and decode tokens/s, the key/value cache bytes on rank 0, the collectives of one decoded
token in rank 0's tensor-parallel group, counted) and writes it as markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from lightning_seqpar.extras import require_extra  # noqa: E402
from recipes.benchmarking.generate_bench import GenerateResult, run_generate_benchmark  # noqa: E402
from recipes.benchmarking.report import publish, settings_and_out  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["layout", "prefill tokens/s", "decode tokens/s", "cache KiB (rank 0)", "collectives per decoded token"]


def rows(results: list[GenerateResult]) -> list[list[str]]:
    return [[r.layout, f"{r.prefill_tokens_per_s:.0f}", f"{r.decode_tokens_per_s:.0f}",
             f"{r.cache_bytes_rank0 / 1024:,.0f}",
             ", ".join(f"{n} {kind}" for kind, n in r.collectives_per_token.items()) or "-"] for r in results]


@hydra.main(config_path=CONF_DIR, config_name="benchmark_generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    require_extra("hf", "recipes/benchmark_generate.py (a Hugging Face Qwen3-MoE)")  # said before any process starts
    settings, out = settings_and_out(cfg)
    results = run_generate_benchmark(settings)
    title = (f"Qwen3-MoE L={cfg.layers} h={cfg.hidden} a={cfg.heads} a_kv={cfg.kv_heads} E={cfg.experts} (top-"
             f"{cfg.top_k}) v={cfg.vocab_size}; {cfg.b} prompts of {cfg.s} tokens per replica, {cfg.n} new tokens "
             f"(greedy), float32 (median of {cfg.iters})")
    body = rows(results)
    publish(out, "benchmark_generate", title, COLUMNS, body, ("layout", "collectives per decoded token"))


if __name__ == "__main__":
    main()
