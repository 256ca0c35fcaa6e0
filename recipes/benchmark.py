"""Per-layer benchmark: Table 4's configurations and torch-native TP + SP, in one run.

    python recipes/benchmark.py                 # tp=2 on CPU (gloo), or on 2 GPUs (NCCL) when present
    python recipes/benchmark.py tp=4 s=1024 h=1024 a=16

Prints a table and writes it as markdown and CSV (``out=...``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from recipes.benchmarking.layer_bench import LayerResult, run_layer_benchmark  # noqa: E402
from recipes.benchmarking.report import print_table, settings_and_out, write_table  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
COLUMNS = ["library", "configuration", "forward ms", "backward ms", "combined ms", "overhead %",
           "kept KiB/layer", "Table 2 KiB", "comm KiB/step"]


def rows(results: list[LayerResult]) -> list[list[str]]:
    baseline = results[0].combined_ms
    return [[r.library, r.configuration, f"{r.forward_ms:.2f}", f"{r.backward_ms:.2f}", f"{r.combined_ms:.2f}",
             f"{100 * (r.combined_ms / baseline - 1):+.0f}", f"{r.kept_bytes / 1024:.0f}", f"{r.model_bytes / 1024:.0f}",
             f"{r.comm_bytes / 1024:.0f}"] for r in results]


def summary(results: list[LayerResult]) -> str:
    ours = next(r for r in results if r.library == "lightning_seqpar" and r.configuration == "sequence parallel")
    native = next(r for r in results if r.library != "lightning_seqpar")
    return (f"TP+SP layer, torch-native / ours: step time x{native.combined_ms / ours.combined_ms:.2f}, "
            f"bytes kept x{native.kept_bytes / ours.kept_bytes:.2f}, bytes communicated x{native.comm_bytes / ours.comm_bytes:.2f}")


@hydra.main(config_path=CONF_DIR, config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> None:
    settings, out = settings_and_out(cfg)
    meta, results = run_layer_benchmark(settings)
    title = (f"One layer, t={meta['t']}, s={cfg.s}, b={cfg.b}, h={cfg.h}, a={cfg.a}, {meta['dtype']}, "
             f"{meta['device']} (median of {cfg.iters})")
    body = rows(results)
    console = Console(width=160)
    print_table(title, COLUMNS, body, ("library", "configuration"), console)
    console.print(summary(results))
    written = write_table(out, "benchmark", title, COLUMNS, body, [summary(results)])
    console.print(f"wrote {written[0]} and {written[1]}")

if __name__ == "__main__":
    main()
