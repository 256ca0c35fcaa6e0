"""The planner's step time and peak bytes against measurement: its best layouts of a small Llama and a few lower-ranked ones, on
this machine, after measuring its rates.

    python recipes/plan_check.py                  # 2 gloo processes on CPU, or one per GPU with NCCL
    python recipes/plan_check.py processes=4 hidden=512

Prints one table (layout, the planner's rank, predicted and measured seconds per step, their ratio, the measured
rank, predicted and measured peak bytes of the most loaded rank and their error) and writes it as markdown and CSV
(``out=...``), beside the rates it measured first (``calibration.json``, which ``python -m lightning_seqpar.plan
--calibration`` reads). See :mod:`recipes.benchmarking.plan_check`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from lightning_seqpar.extras import require_extra  # noqa: E402
from recipes.benchmarking.plan_check import CheckRow, run_plan_check  # noqa: E402
from recipes.benchmarking.report import print_table, settings_and_out, write_table  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["layout", "planned rank", "predicted s", "measured s", "predicted / measured", "measured rank",
           "predicted peak MB", "measured peak MB", "peak error", "timing"]


def rows(results: list[CheckRow]) -> list[list[str]]:
    order = sorted(range(len(results)), key=lambda i: results[i].measured_s)
    measured_rank = {i: n + 1 for n, i in enumerate(order)}
    return [[r.layout, str(r.planned_rank), f"{r.predicted_s:.3f}", f"{r.measured_s:.3f}",
             f"{r.predicted_s / r.measured_s:.2f}", str(measured_rank[i]), f"{r.predicted_peak / 1e6:.2f}",
             f"{r.measured_peak / 1e6:.2f}", f"{r.predicted_peak / r.measured_peak - 1:+.1%}", r.timing]
            for i, r in enumerate(results)]


@hydra.main(config_path=CONF_DIR, config_name="plan_check", version_base="1.3")
def main(cfg: DictConfig) -> None:
    require_extra("hf", "recipes/plan_check.py (a Hugging Face Llama or Qwen3-MoE)")  # said before any process starts
    settings, out = settings_and_out(cfg)
    out.mkdir(parents=True, exist_ok=True)
    settings["calibration_out"] = str(out / "calibration.json")  # the rates the predictions used
    results = run_plan_check(settings)
    model = (f"Llama L={cfg.layers} h={cfg.hidden} f={cfg.ffn}" if cfg.family == "llama" else
             f"Qwen3-MoE L={cfg.layers} h={cfg.hidden} {cfg.experts} experts of {cfg.expert_width}, top {cfg.top_k}")
    lora = f" + LoRA r {cfg.lora_r} on q, v" if cfg.lora_r else ""
    title = (f"Planned against measured step time and peak bytes: {model} a={cfg.heads} v={cfg.vocab_size}{lora}, "
             f"{cfg.global_batch} x {cfg.s} tokens per step, {cfg.precision}, {cfg.processes} processes (median of "
             f"{cfg.steps} steps after {cfg.warmup}; rates measured first)")
    body = rows(results)
    console = Console(width=180)
    print_table(title, COLUMNS, body, ("layout", "timing"), console)
    written = write_table(out, "plan_check", title, COLUMNS, body)
    console.print(f"wrote {written[0]}, {written[1]} and the rates the predictions used, "
                  f"{settings['calibration_out']} (python -m lightning_seqpar.plan ... --calibration FILE)")


if __name__ == "__main__":
    main()
