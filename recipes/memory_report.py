"""``python recipes/memory_report.py [--png figure7.png]``: the paper's memory and FLOPs figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tools are the recipes package's

from recipes.benchmarking.memory_tables import (  # noqa: E402
    GiB, choice_rows, context_rows, extra_fraction, flops_rows, memory_rows, write_figure7,
)
from recipes.benchmarking.paper import PAPER_RUNS  # noqa: E402


def main(argv=None) -> None:
    """Print the memory and FLOPs tables for Table 3's runs; write the Figure-7 PNG only when ``--png`` is given."""
    parser = argparse.ArgumentParser(prog="python recipes/memory_report.py", description=__doc__)
    parser.add_argument("--png", default=None, help="write the Figure-7 bar chart to this file (nothing is written without it)")
    args = parser.parse_args(argv)
    console = Console(width=140)

    rows = memory_rows()
    table = Table(title="Activation memory (Table 2, Eq. 5/6; 16-bit, t = 8, s = 2048)")
    for col in ("model", "technique", "per layer (GiB)", "% of TP (Fig. 7)", "first stage (GiB)"):
        table.add_column(col, justify="left" if col in ("model", "technique") else "right")
    for r in rows:
        table.add_row(r.model, r.technique, f"{r.layer_bytes / GiB:.3f}", f"{r.percent_of_tp:.1f}",
                      f"{r.first_stage_bytes / GiB:.2f}")
    console.print(table)
    console.print("§4.3 extra terms (embedding dropout, final norm, output layer, fp32 logits) as % of Eq. 5: "
                  + ", ".join(f"{name} {100 * extra_fraction(run):.2f}%" for name, run in PAPER_RUNS.items()))

    table = Table(title="FLOPs (Eq. 7 model, Eq. 8 hardware) at 312 TFLOP/s per A100, Table 5 iteration times")
    for col in ("model", "selective overhead", "MFU", "MFU printed", "HFU", "HFU printed", "vs full recompute"):
        table.add_column(col, justify="right")
    for r in flops_rows():
        table.add_row(r.model, f"{100 * r.selective_overhead:.2f}%", f"{100 * r.mfu:.1f}%", f"{100 * r.mfu_printed:.1f}%",
                      f"{100 * r.hfu:.1f}%", f"{100 * r.hfu_printed:.1f}%", f"+{100 * r.throughput_increase:.1f}%")
    console.print(table)
    table = Table(title="Context parallelism at s = 32768 (TP + SP + selective at c = 1; ring attention's blockwise "
                        "kernel at c > 1; 16-bit, each run's t)")
    for col in ("model", "c", "per layer per rank (GiB)", "÷ at c = 1", "ring buffers (GiB)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    base = {}
    for r in context_rows():
        base.setdefault(r.model, r.layer_bytes)
        table.add_row(r.model, str(r.c), f"{r.layer_bytes / GiB:.3f}", f"{base[r.model] / r.layer_bytes:.2f}",
                      f"{r.ring_bytes / GiB:.3f}")
    console.print(table)
    table = Table(title="Recomputation by module and activation offload (per layer and micro-batch, one rank, t of "
                        "Table 3 with SP, 16-bit)")
    for col in ("model", "choice", "on the device (GiB)", "to the host and back (GiB)"):
        table.add_column(col, justify="left" if col in ("model", "choice") else "right")
    for r in choice_rows():
        table.add_row(r.model, r.choice, f"{r.device_bytes / GiB:.3f}", f"{r.host_bytes / GiB:.3f}")
    console.print(table)
    if args.png:
        console.print(f"wrote {write_figure7(rows, args.png)}")


if __name__ == "__main__":
    main()
