"""``explain(..., pp=)`` reports a schedule's bubble and each rank's peak from the lists the executor runs, and turns
the peak into bytes with the layer's memory choices; bad pipeline settings are refused as the strategy refuses them."""

import pytest
import torch.nn as nn

from lightning_seqpar import explain
from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.report import COST_MODELS, schedule_report
from lightning_seqpar.pipeline_parallel.schedules import bubble_fraction, simulate
from tests.helpers.models import build


@pytest.mark.parametrize("schedule,p,m", [("1F1B", 4, 8), ("ZB-H1", 4, 8), ("ZB-V", 4, 8), ("DualPipeV", 4, 8),
                                          ("ZB-V", 8, 32), ("interleaved_1F1B", 2, 4)])
def test_the_report_is_the_schedule_s_own_bubble_and_peak(schedule, p, m):
    v = 2 if schedule == "interleaved_1F1B" else 1
    report = schedule_report(PipelineConfig.build(p, m, schedule, v), layers=4 * p)
    chunks = 2 if schedule in ("ZB-V", "DualPipeV", "interleaved_1F1B") else 1
    assert report.chunks == chunks
    assert report.bubble == {name: bubble_fraction(report.schedule, m, p, chunks, costs)
                             for name, costs in COST_MODELS.items()}
    assert report.peak == tuple(simulate(report.schedule, m, p, chunks))
    assert report.chunk_layers == (4 // chunks,) * p


def test_the_issue_s_goals_read_from_the_report():
    one_f_one_b = schedule_report(PipelineConfig.build(4, 8, "1F1B"))
    assert f"{one_f_one_b.bubble['F = B = W']:.4f}" == "0.2727"
    for schedule in ("ZB-V", "DualPipeV"):  # the least p ranks reach: rank r waits r chunk forwards to start
        for p, m in ((4, 8), (8, 32)):
            assert schedule_report(PipelineConfig.build(p, m, schedule)).bubble["F = B = W"] == pytest.approx(
                (p - 1) / (6 * m + p - 1), abs=1e-12)
    # ZB-H1 keeps 1F1B's peak in layers: p chunk micro-batches of L/p layers on rank 0
    assert schedule_report(PipelineConfig.build(4, 8, "ZB-H1")).peak[0] == one_f_one_b.peak[0] == 4


def test_explain_prints_the_schedule_under_the_rewrite_and_its_peak_bytes_per_memory_choice(capsys):
    plan = explain(build("hf", layers=4), tp=2, pp=2, schedule="ZB-V", num_microbatches=4, seq_len=32)
    report = plan.pipeline
    assert report.schedule == "ZB-V" and report.chunk_layers == (1, 1)
    rows = {row.choice: row.device_bytes for row in plan.memory.rows}
    assert report.layer_bytes == rows
    for choice, per_layer in rows.items():
        assert report.peak_bytes(choice) == tuple(n * 1 * per_layer for n in report.peak)
    printed = capsys.readouterr().out
    assert "Pipeline schedule ZB-V at p=2, m=4, v=2:" in printed and "peak activation MiB per rank" in printed
    with pytest.raises(KeyError, match="'nothing'"):
        report.peak_bytes("nothing")
    assert explain(build("hf", layers=4), tp=2).pipeline is None  # pp = 1: no schedule


def test_an_uneven_split_and_a_torch_encoder_are_split_as_the_strategy_splits_them():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, norm_first=True, batch_first=True), 6,
                                    enable_nested_tensor=False)
    report = explain(encoder, tp=2, pp=2, pipeline_split=[4, 2]).pipeline
    assert report.chunk_layers == (4, 2) and report.peak == (2, 1)
    v_shaped = explain(encoder, tp=2, pp=2, schedule="ZB-V", pipeline_split=[2, 1, 1, 2]).pipeline
    assert v_shaped.chunk_layers == (2, 1)  # rank 0 holds stages 0 and 3 (the V), rank 1 stages 1 and 2


def test_bad_pipeline_settings_are_refused_as_the_strategy_refuses_them():
    model = build("hf", layers=4)
    with pytest.raises(ValueError, match=r"num_microbatches=3 is smaller than 2·pp=4"):
        explain(model, tp=2, pp=2, schedule="DualPipeV", num_microbatches=3)
    with pytest.raises(ValueError, match="schedule=.zero.: one of 1F1B"):
        explain(model, tp=2, pp=2, schedule="zero")
    with pytest.raises(ValueError, match="do not divide into 3 equal pipeline stages"):
        explain(model, tp=2, pp=3)
    with pytest.raises(ValueError, match="at least 2 pipeline ranks"):
        schedule_report(PipelineConfig.build(1))
