"""The configurations of Korthikanti et al. 2022 (Tables 3 and 5), for the report and its tests."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_seqpar.memory.activations import TransformerShape

A100_BF16_PEAK_FLOPS = 312e12
"""Dense 16-bit peak of an A100 (FLOP/s); reproduces Table 5's MFU/HFU."""


@dataclass(frozen=True)
class PaperRun:
    """One row of Table 3, with its Table 5 iteration times."""

    name: str
    shape: TransformerShape
    """s, micro-batch b, h, a, L, v"""
    t: int
    """tensor-parallel size"""
    p: int
    """pipeline-parallel size"""
    m: int
    """model chunks per pipeline rank (interleaved schedule; 1 = plain 1F1B)"""
    gpus: int
    global_batch: int
    """sequences per iteration"""
    time_full_recompute_s: float
    """Table 5: iteration time with full recomputation, no SP (seconds)"""
    time_present_work_s: float
    """Table 5: iteration time with SP + selective recomputation (seconds)"""
    mfu: float
    """Table 5, as printed (fraction)"""
    hfu: float
    """Table 5, as printed (fraction)"""


def _shape(a: int, h: int, L: int, b: int) -> TransformerShape:
    return TransformerShape(s=2048, b=b, h=h, a=a, L=L, v=51200)


PAPER_RUNS: dict[str, PaperRun] = {
    "22B": PaperRun("22B", _shape(64, 6144, 48, 4), 8, 1, 1, 8, 4, 1.42, 1.10, 0.415, 0.437),
    "175B": PaperRun("175B", _shape(96, 12288, 96, 1), 8, 8, 3, 64, 64, 18.13, 13.75, 0.514, 0.528),
    "530B": PaperRun("530B", _shape(128, 20480, 105, 1), 8, 35, 3, 280, 280, 49.05, 37.83, 0.560, 0.570),
    "1T": PaperRun("1T", _shape(160, 25600, 128, 1), 8, 64, 1, 512, 512, 94.42, 71.49, 0.563, 0.570),
}
"""Table 3 (s = 2048, v = 51200, t = 8; interleaving m = 3 for 175B and 530B, §6) and Table 5."""
