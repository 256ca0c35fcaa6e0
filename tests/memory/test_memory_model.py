"""The analytic model states the paper's numbers: Table 2, Eq. 5/6, §4.3, Eq. 7/8, §5's overheads, Table 5."""

import itertools

import pytest

from lightning_seqpar.memory import (
    TransformerShape,
    extra_activation_bytes,
    first_stage_activation_bytes,
    hardware_flops_per_iteration,
    interleave_factor,
    layer_activation_bytes,
    model_flops_per_iteration,
    recompute_flops_overhead,
)
from recipes.memory_report import main
from recipes.benchmarking.paper import PAPER_RUNS
from recipes.benchmarking.memory_tables import GiB, context_rows, extra_fraction, flops_rows, memory_rows

SHAPES = [TransformerShape(s=2048, b=1, h=12288, a=96), TransformerShape(s=512, b=3, h=1024, a=16),
          TransformerShape(s=96, b=2, h=64, a=4)]


@pytest.mark.parametrize("shape,t", list(itertools.product(SHAPES, [1, 2, 8])))
def test_layer_bytes_are_table_2(shape, t):
    s, b, h, a = shape.s, shape.b, shape.h, shape.a
    sbh = s * b * h
    expected = {  # Table 2, verbatim
        (False, "none"): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        (True, "none"): sbh * (34 / t + 5 * a * s / (h * t)),
        (False, "selective"): sbh * (10 + 24 / t),
        (True, "selective"): sbh * 34 / t,
        (False, "full"): sbh * 2,
    }
    for (sp, recompute), want in expected.items():
        assert layer_activation_bytes(shape, t, sp, recompute) == pytest.approx(want, rel=1e-12)
    if t == 1:  # Eq. 1
        assert layer_activation_bytes(shape) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    # Under SP the full-recompute checkpoint is the local sequence shard.
    assert layer_activation_bytes(shape, t, True, "full") == pytest.approx(2 * sbh / t, rel=1e-12)


def test_mlp_width_generalises_the_24_and_34():
    shape = TransformerShape(s=64, b=2, h=32, a=4, ffn_hidden_size=96)
    sbh = 64 * 2 * 32
    # Megatron-Core: sbh(18 + 4f/h) outside core attention; (8 + 4f/h)·sbh/t is the sharded part.
    assert layer_activation_bytes(shape, 1, False, "selective") == 18 * sbh + 4 * 64 * 2 * 96
    assert layer_activation_bytes(shape, 4, False, "selective") == 10 * sbh + (8 * sbh + 4 * 64 * 2 * 96) / 4


def test_figure_7_percentages_and_first_stage_gib():
    rows = {(r.model, r.technique): r for r in memory_rows()}
    # The coefficients Table 2 and Eq. 5 give for Table 3's models (s = 2048, v = 51200, t = 8).
    expected_percent = {
        "22B": (66.8, 49.4, 16.1, 7.6), "175B": (62.0, 56.5, 18.5, 8.7),
        "530B": (58.3, 61.9, 20.2, 9.5), "1T": (58.3, 61.9, 20.2, 9.5),
    }
    for model, percents in expected_percent.items():
        for technique, want in zip(("TP + SP", "TP + selective", "TP + SP + selective", "full recompute"), percents):
            assert round(rows[model, technique].percent_of_tp, 1) == want, (model, technique)
    expected_gib = {"22B": (59.25, 9.56), "175B": (66.84, 12.35), "530B": (114.02, 23.08), "1T": (131.25, 26.56)}
    for model, (eq2, eq6) in expected_gib.items():
        assert round(rows[model, "TP (baseline)"].first_stage_bytes / GiB, 2) == eq2
        assert round(rows[model, "TP + SP + selective"].first_stage_bytes / GiB, 2) == eq6
    # Eq. 1 per layer (no parallelism).
    for model, gib in {"22B": 6.59, "175B": 2.67, "530B": 3.83, "1T": 4.79}.items():
        assert round(layer_activation_bytes(PAPER_RUNS[model].shape) / GiB, 2) == gib
    # §6.1: "combined provide a 5x reduction ... under 20%" and full recomputation "at 10% of the baseline".
    assert all(rows[m, "TP + SP + selective"].percent_of_tp < 21 for m in expected_percent)


def test_interleave_factor_and_eq5():
    assert interleave_factor(8, 1) == 1
    assert interleave_factor(8, 3) == pytest.approx(1 + 7 / 24)
    assert interleave_factor(35, 3) == pytest.approx(1 + 34 / 105)
    shape = PAPER_RUNS["175B"].shape
    sbhL = shape.s * shape.b * shape.h * shape.L
    # Eq. 5 is independent of p under plain 1F1B.
    for p in (1, 4, 8):
        assert first_stage_activation_bytes(shape, 8, p, 1, True) == pytest.approx(
            sbhL / 8 * (34 + 5 * shape.a * shape.s / shape.h))
    with pytest.raises(ValueError, match="p and m must be >= 1"):
        interleave_factor(0, 1)


def test_extra_terms_of_section_4_3():
    run = PAPER_RUNS["22B"]
    s, b, h, v, t = run.shape.s, run.shape.b, run.shape.h, run.shape.v, run.t
    sbh = s * b * h
    extra = sum(extra_activation_bytes(run.shape, t, 1).values())
    # (sbhL/t)·(p/L + δ(p=1)·(4/L)·(1 + v/h))
    assert extra == pytest.approx(sbh * run.shape.L / t * (1 / run.shape.L + 4 / run.shape.L * (1 + v / h)))
    assert round(100 * extra_fraction(run), 2) == 0.57  # not the paper's "0.01%": see paper notes §2.5
    # With p > 1 the first stage holds only the embedding dropout of p micro-batches.
    assert extra_activation_bytes(run.shape, t, 4) == {"embedding dropout mask": sbh * 4 / t}


def test_flops_equations_7_and_8():
    for run in PAPER_RUNS.values():
        sh, B = run.shape, run.global_batch
        s, h, L, v = sh.s, sh.h, sh.L, sh.v
        base = 72 * B * L * s * h * h
        assert model_flops_per_iteration(sh, B) == pytest.approx(base * (1 + s / (6 * h) + v / (12 * h * L)))
        assert hardware_flops_per_iteration(sh, B, "selective") == pytest.approx(base * (1 + s / (3 * h) + v / (12 * h * L)))
        assert hardware_flops_per_iteration(sh, B, "full") == pytest.approx(
            96 * B * L * s * h * h * (1 + s / (6 * h) + v / (16 * h * L)))
        assert hardware_flops_per_iteration(sh, B, "none") == model_flops_per_iteration(sh, B)


def test_selective_overheads_and_table_5():
    # §5: "only 2.7% and 1.6% FLOPs overhead" for GPT-3 and MT-NLG.
    assert round(100 * recompute_flops_overhead(PAPER_RUNS["175B"].shape), 1) == 2.7
    assert round(100 * recompute_flops_overhead(PAPER_RUNS["530B"].shape), 1) == 1.6
    for row in flops_rows():
        # Table 5 from its own iteration times at 312 TFLOP/s; 22B's 1.10 s is rounded (41.7 vs 41.5).
        assert abs(row.mfu - row.mfu_printed) < 0.0025, row
        assert abs(row.hfu - row.hfu_printed) < 0.0015, row
    assert [round(100 * r.throughput_increase, 0) for r in flops_rows()] == [29, 32, 30, 32]


def test_report_prints_tables_and_writes_figure_7(tmp_path, capsys):
    png = tmp_path / "figure7.png"
    main(["--png", str(png)])
    out = capsys.readouterr().out
    assert "TP + SP + selective" in out and "530B" in out and "2.69%" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_writes_no_file_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main([])
    assert "Activation memory" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_report_shows_context_parallelism_dividing_each_layer():
    rows = {(r.model, r.c): r for r in context_rows()}
    for model in ("22B", "175B", "530B", "1T"):
        one, eight = rows[(model, 1)], rows[(model, 8)]
        # c = 1 is Table 2's 34·sbh/t; at c > 1 the kernel's output and log-sum-exp join, all over c
        assert 7.5 < one.layer_bytes / eight.layer_bytes < 8
        assert rows[(model, 2)].layer_bytes == 4 * eight.layer_bytes
        assert one.ring_bytes == 0 and rows[(model, 2)].ring_bytes == 4 * eight.ring_bytes > 0


def test_the_report_shows_each_memory_choice_leaving_the_device_or_moving_to_the_host(capsys):
    from recipes.benchmarking.memory_tables import choice_rows

    from recipes.benchmarking.paper import PAPER_RUNS

    for run in PAPER_RUNS.values():
        model, sbt = run.name, run.shape.s * run.shape.b / run.t
        rows = {r.choice: r for r in choice_rows() if r.model == model}
        selective, full = rows["selective"], rows["full"]
        # an offload moves exactly what it removes; recomputation moves nothing
        for name in ("selective | offload attn_norm, mlp_norm", "selective | offload all but core_attn"):
            assert rows[name].device_bytes + rows[name].host_bytes == selective.device_bytes
        assert all(r.host_bytes == 0 for n, r in rows.items() if "offload" not in n)
        # the norms' two 16-bit outputs 2·2sbh/t; the MLP's fc2 and GeLU inputs 2·2sbf/t
        assert selective.device_bytes - rows["selective + layernorm"].device_bytes == 4 * sbt * run.shape.h
        assert selective.device_bytes - rows["selective + mlp"].device_bytes == 4 * sbt * run.shape.f
        assert full.device_bytes < rows["selective + layernorm + mlp"].device_bytes < rows["selective + mlp"].device_bytes
    main([])
    assert "Recomputation by module and activation offload" in capsys.readouterr().out
