"""The paper's memory and FLOPs figures, computed from the model: Table 2 per technique (Figure 7),
Eq. 5/6 first-stage totals, §5's recompute overheads and Table 5's MFU/HFU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

from lightning_seqpar.memory.activations import (
    Recompute,
    extra_activation_bytes,
    first_stage_activation_bytes,
    layer_activation_bytes,
)
from lightning_seqpar.memory.choices import choice_bytes
from lightning_seqpar.memory.flops import (
    flops_utilization,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    recompute_flops_overhead,
)
from recipes.benchmarking.paper import A100_BF16_PEAK_FLOPS, PAPER_RUNS, PaperRun

GiB = 2**30

TECHNIQUES: dict[str, tuple[bool, Recompute]] = {  # Figure 7's bars: (sequence parallel, recompute)
    "TP (baseline)": (False, "none"),
    "TP + SP": (True, "none"),
    "TP + selective": (False, "selective"),
    "TP + SP + selective": (True, "selective"),
    "full recompute": (False, "full"),
}


@dataclass(frozen=True)
class MemoryRow:
    """Figure 7 / Table 2 figures of one technique for one of the paper's runs (bytes, %)."""

    model: str
    technique: str
    layer_bytes: float
    """Table 2: per layer, one tensor-parallel rank"""
    percent_of_tp: float
    """Figure 7: of the TP baseline's per-layer bytes"""
    first_stage_bytes: float
    """Eq. 5 (Eq. 6 with selective), interleave factor included, extras excluded"""


def memory_rows(runs: dict[str, PaperRun] = PAPER_RUNS) -> list[MemoryRow]:
    """Every technique of :data:`TECHNIQUES` for every run (t, p, m of Table 3 and §6)."""
    rows = []
    for run in runs.values():
        baseline = layer_activation_bytes(run.shape, run.t)
        for technique, (sp, recompute) in TECHNIQUES.items():
            per_layer = layer_activation_bytes(run.shape, run.t, sp, recompute)
            total = first_stage_activation_bytes(run.shape, run.t, run.p, run.m, sp, recompute)
            rows.append(MemoryRow(run.name, technique, per_layer, 100 * per_layer / baseline, total))
    return rows


@dataclass(frozen=True)
class ChoiceRow:
    """One memory choice for one of the paper's runs at its t with SP: bytes per layer and micro-batch, one rank."""

    model: str
    choice: str
    device_bytes: float
    """kept on the device for backward (:func:`~lightning_seqpar.memory.activations.layer_activation_terms`)"""
    host_bytes: float
    """copied to host memory and back (:func:`~lightning_seqpar.memory.activations.offloaded_activation_terms`)"""


def choice_rows(runs: dict[str, PaperRun] = PAPER_RUNS) -> list[ChoiceRow]:
    """Every memory choice of :data:`~lightning_seqpar.memory.choices.MEMORY_CHOICES` for every run, with SP at its
    t (:func:`~lightning_seqpar.memory.choices.choice_bytes`)."""
    return [ChoiceRow(run.name, row.choice, row.device_bytes, row.host_bytes)
            for run in runs.values() for row in choice_bytes(run.shape, run.t, True)]


def extra_fraction(run: PaperRun) -> float:
    """§4.3's extra terms as a fraction of Eq. 5 (TP + SP, no recompute) for ``run``."""
    extra = sum(extra_activation_bytes(run.shape, run.t, run.p).values())
    return extra / first_stage_activation_bytes(run.shape, run.t, run.p, 1, True, "none")


@dataclass(frozen=True)
class FlopsRow:
    """§5's overhead and Table 5's MFU/HFU (fractions) for one of the paper's runs, computed and printed."""

    model: str
    selective_overhead: float
    """hardware/model FLOPs − 1 with selective recomputation (§5)"""
    mfu: float
    hfu: float
    """from Table 5's present-work iteration time at 312 TFLOP/s per A100"""
    mfu_printed: float
    hfu_printed: float
    throughput_increase: float
    """Table 5: full-recompute time / present-work time − 1"""


def flops_rows(runs: dict[str, PaperRun] = PAPER_RUNS, peak_flops: float = A100_BF16_PEAK_FLOPS) -> list[FlopsRow]:
    """Eq. 7/8 FLOPs of each run's global batch over its Table 5 present-work time, at ``peak_flops`` per GPU."""
    rows = []
    for run in runs.values():
        model = model_flops_per_iteration(run.shape, run.global_batch)
        hardware = hardware_flops_per_iteration(run.shape, run.global_batch, "selective")
        rows.append(FlopsRow(
            run.name, recompute_flops_overhead(run.shape, "selective"),
            flops_utilization(model, run.time_present_work_s, run.gpus, peak_flops),
            flops_utilization(hardware, run.time_present_work_s, run.gpus, peak_flops),
            run.mfu, run.hfu, run.time_full_recompute_s / run.time_present_work_s - 1,
        ))
    return rows


def write_figure7(rows: list[MemoryRow], path: Union[str, Path]) -> Path:
    """Figure 7 as a grouped bar chart (PNG): per-layer activations as % of the TP baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    techniques = [t for t in TECHNIQUES if t != "TP (baseline)"]
    width = 0.8 / len(techniques)
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, technique in enumerate(techniques):
        values = [next(r.percent_of_tp for r in rows if r.model == m and r.technique == technique) for m in models]
        bars = ax.bar([i + (k - (len(techniques) - 1) / 2) * width for i in range(len(models))], values, width,
                      label=technique)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("activation memory, % of tensor-parallel baseline")
    ax.set_title("Korthikanti et al. 2022, Figure 7 (from Table 2, t = 8)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class ContextRow:
    """Per-layer activation bytes of one of the paper's runs at a longer sequence, split over c context ranks."""

    model: str
    s: int
    c: int
    layer_bytes: float
    """kept per layer per rank: TP + SP + selective (c = 1), or the blockwise kernel's terms (c > 1)"""
    ring_bytes: float
    """the ring's K/V held and arriving, and the travelling dK/dV, while one layer's attention runs"""


def context_rows(runs: dict[str, PaperRun] = PAPER_RUNS, s: int = 32768, cps: tuple[int, ...] = (1, 2, 4, 8)
                 ) -> list[ContextRow]:
    """Each run's shape at sequence ``s`` under its t with SP: per-layer bytes for every c of ``cps``
    (:func:`~lightning_seqpar.memory.layer_activation_bytes` with ``c``) and the ring's buffers."""
    from dataclasses import replace

    from lightning_seqpar.memory import context_parallel_buffer_bytes

    rows = []
    for run in runs.values():
        shape = replace(run.shape, s=s)
        for c in cps:
            ring = sum(context_parallel_buffer_bytes(shape, run.t, c, "ring").values()) if c > 1 else 0.0
            rows.append(ContextRow(run.name, s, c, layer_activation_bytes(shape, run.t, True, "selective", c=c), ring))
    return rows
