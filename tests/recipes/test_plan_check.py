"""``recipes/plan_check.py``: after measuring the machine's rates, the planner's best layouts and a lower-ranked one
of a small Llama train on 2 gloo processes, each with its predicted (calibrated) and measured seconds per step, and
its predicted and measured peak bytes (within 5 %; 15 % for ZB-H1, a known gap); so do a small Qwen3-MoE's two best,
its expert grid searched (within 8 %), and a LoRA model's two best, its frozen base probed as it trains (within 8 %),
and its layouts once mis-priced under every precision (within 5 %)."""

import pytest
import torch

from lightning_seqpar.plan.measuring.calibration import COLLECTIVES, StepCalibration
from recipes.benchmarking.plan_check import CheckRow, check
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CFG = dict(vocab_size=64, hidden=32, ffn=64, heads=4, layers=2, s=32, global_batch=4, micro_batches=[1, 2],
           precision="32-true", top=2, lower=1, warmup=2, steps=2, repeats=1)


def test_the_best_and_a_lower_ranked_layout_are_predicted_from_measured_rates_and_timed(tmp_path):
    rates = tmp_path / "calibration.json"
    ranks = run_distributed(check, 2, dict(CFG, calibration_out=str(rates)), torch.device("cpu"))
    assert ranks[0] == ranks[1]  # every rank returns the same rows (the slowest rank's time)
    rows = ranks[0]
    assert [r.planned_rank for r in rows][:2] == [1, 2] and len(rows) == 3 and rows[2].planned_rank > 2
    assert len({r.layout for r in rows}) == 3
    for row in rows:
        assert row.timing == "measured rates"
        assert row.predicted_s > 0 and row.measured_s > 0
        # Within 5 %, but for ZB-H1 with few micro-batches (+10 to +12 % at m = 2, docs/plan.md): the planner prices
        # it as 1F1B's peak, which the deferred W lowers in the run; a known gap kept visible here rather than hidden.
        bound = 0.15 if "ZB-H1" in row.layout else 0.05
        assert row.measured_peak > 0 and abs(row.predicted_peak / row.measured_peak - 1) < bound, row
    predicted = [r.predicted_s for r in rows]
    assert predicted == sorted(predicted)  # the planner's order
    written = StepCalibration.load(rates)  # the rates the predictions used, as the planner's CLI reads them
    assert written.world == 2 and {kind for kind, _, _ in written.collectives} == set(COLLECTIVES)


MOE = dict(CFG, family="qwen3_moe", experts=4, expert_width=16, top_k=2, top=2, lower=0)


def test_a_mixture_of_experts_is_planned_with_its_expert_grid_and_measured():
    # Qwen3-MoE (4 experts, top 2): the planner searches ep and expert_tp too; its two best layouts' peaks within 8 %
    # (a rank's routed rows vary with the routing, which the planner prices balanced), 15 % for the zero-bubble ones
    # (the known gap above).
    rows = run_distributed(check, 2, MOE, torch.device("cpu"))[0]
    assert [r.planned_rank for r in rows] == [1, 2]
    for row in rows:
        bound = 0.15 if "ZB-" in row.layout else 0.08
        assert row.measured_s > 0 and abs(row.predicted_peak / row.measured_peak - 1) < bound, row


LORA = dict(CFG, lora_r=4, layers=4, top=2, lower=0)


def test_lora_is_planned_as_it_trains_and_measured():
    # LoRA on q and v (PEFT), the base frozen: the probes are wrapped and frozen as the run is, so a frozen
    # projection's input is not priced as kept (the fully trained probes put these rows 35-59 % over). Within 8 %:
    # the first layer, whose input has no gradient under a frozen embedding, keeps less than the probed middle one.
    rows = run_distributed(check, 2, LORA, torch.device("cpu"))[0]
    assert [r.planned_rank for r in rows] == [1, 2]
    for row in rows:
        assert row.measured_s > 0 and abs(row.predicted_peak / row.measured_peak - 1) < 0.08, row


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_lora_peaks_are_predicted_within_5_percent_under_every_precision(precision):
    # The layouts LoRA was once mis-priced on under bf16-mixed (−50.8 % at mbs 4 with full recomputation: the first
    # layer's saving taken off twice), named as the table prints them: full recomputation at mbs 4 and 1, none at
    # mbs 4, and tp 2.
    layouts = ["tp 1 pp 1 dp 2 mbs 4 full", "tp 1 pp 1 dp 2 mbs 1 full", "tp 1 pp 1 dp 2 mbs 4 none",
               "tp 2 pp 1 dp 1 mbs 4 selective"]
    rows = run_distributed(check, 2, dict(LORA, precision=precision, layouts=layouts, micro_batches=[1, 4],
                                          global_batch=8),
                           torch.device("cpu"))[0]
    assert [r.layout for r in rows] == layouts
    for row in rows:
        assert row.measured_peak > 0 and abs(row.predicted_peak / row.measured_peak - 1) < 0.05, row


def test_the_table_ranks_the_measured_times():
    from recipes.plan_check import rows

    body = rows([CheckRow("a", 1, 1.0, 2.0, "measured rates", 2.1e6, 2e6),
                 CheckRow("b", 2, 1.5, 1.0, "measured rates", 1e6, 1e6)])
    assert [(r[0], r[4], r[5], r[6], r[7], r[8]) for r in body] == [("a", "0.50", "2", "2.10", "2.00", "+5.0%"),
                                                                   ("b", "1.50", "1", "1.00", "1.00", "+0.0%")]
