"""Expert-parallel benchmark: a Qwen3-MoE on 4 processes with its experts whole on each rank (ep 1) and split over 2
and 4 ranks, and transformers' own expert parallelism on the same model and data, in one run.

    python recipes/benchmark_moe.py                 # on CPU (gloo), or on 4 GPUs (NCCL)
    python recipes/benchmark_moe.py s=1024 experts=16

Prints one table (tokens/s, bytes rank 0 sends per step by kind, expert parameters per rank; under LoRA, on the
attention alone or on the experts too, the adapter bytes per rank) and writes it as markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from lightning_seqpar.extras import require_extra  # noqa: E402
from recipes.benchmarking.moe_bench import KINDS, MoEResult, run_moe_benchmark  # noqa: E402
from recipes.benchmarking.report import publish, settings_and_out  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["layout", "tokens/s"] + [f"{k} KiB" for k in KINDS] + ["expert params/rank", "adapter KiB/rank"]


def rows(results: list[MoEResult]) -> list[list[str]]:
    return [[r.layout, f"{r.tokens_per_s:.0f}"] + [f"{r.sent_kib[k]:.0f}" if k in r.sent_kib else "-" for k in KINDS]
            + [f"{r.expert_params_per_rank:,}", f"{r.adapter_bytes_per_rank / 1024:,.0f}"
               if r.adapter_bytes_per_rank else "-"] for r in results]


@hydra.main(config_path=CONF_DIR, config_name="benchmark_moe", version_base="1.3")
def main(cfg: DictConfig) -> None:
    require_extra("hf", "recipes/benchmark_moe.py (a Hugging Face Qwen3-MoE)")  # said before any process starts
    require_extra("peft", "recipes/benchmark_moe.py (its LoRA rows)")
    settings, out = settings_and_out(cfg)
    results = run_moe_benchmark(settings)
    title = (f"Qwen3-MoE L={cfg.layers} h={cfg.hidden} a={cfg.heads} E={cfg.experts} (f={cfg.expert_width}, top-"
             f"{cfg.top_k}) v={cfg.vocab_size}, {cfg.b} x {cfg.s} tokens per replica and step, float32, 4 processes "
             f"(median of {cfg.iters}; bytes of one more forward/backward sent by rank 0)")
    body = rows(results)
    publish(out, "benchmark_moe", title, COLUMNS, body, ("layout",))


if __name__ == "__main__":
    main()
