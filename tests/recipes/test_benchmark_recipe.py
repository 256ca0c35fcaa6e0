"""``recipes/benchmark.py`` runs Table 4's configurations and torch-native TP+SP in one run and writes its table."""

import csv
import math
import sys

import pytest

from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def test_benchmark_recipe_writes_table_with_every_row(tmp_path):
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark.py"), "s=32", "h=32", "a=4", "b=2", "iters=1", "warmup=0",
           f"out={tmp_path}"]
    run_job(cmd, tmp_path, timeout=300)
    with open(tmp_path / "benchmark.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["library"], r["configuration"]) for r in table] == [
        ("lightning_seqpar", "baseline (no recompute)"), ("lightning_seqpar", "sequence parallel"),
        ("lightning_seqpar", "full recompute"), ("lightning_seqpar", "selective recompute"),
        ("lightning_seqpar", "selective + sequence parallel"), ("torch-native TP+SP", "sequence parallel"),
    ]
    kept = {(r["library"], r["configuration"]): float(r["kept KiB/layer"]) for r in table}
    # Our column-parallel layers keep the local sequence shard; torch-native keeps the gathered input.
    assert kept["lightning_seqpar", "sequence parallel"] < kept["torch-native TP+SP", "sequence parallel"]
    assert kept["lightning_seqpar", "selective + sequence parallel"] < kept["lightning_seqpar", "sequence parallel"]
    assert "torch-native / ours" in (tmp_path / "benchmark.md").read_text()


def test_training_benchmark_recipe_writes_one_table_for_both_libraries(tmp_path):
    # Three of the ten rows (all ten take about two minutes on 2 cores): the distributed optimizer, Muon, FSDP2.
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark_training.py"), "n_layer=1", "n_embd=32", "n_head=4",
           "s=32", "vocab_size=64", "global_batch=4", "iters=1", "warmup=0",
           'only=["tp 2 x dp 2 zero 1","tp 2, muon","tp 2 x dp 2 FSDP2"]', f"out={tmp_path}"]
    run_job(cmd, tmp_path, timeout=400)
    with open(tmp_path / "benchmark_training.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["library"], r["layout"], r["processes"]) for r in table] == [
        ("lightning_seqpar", "tp 2 x dp 2 zero 1", "4"), ("lightning_seqpar", "tp 2, muon", "2"),
        ("torch-native", "tp 2 x dp 2 FSDP2", "4")]
    for row in table:
        assert float(row["tokens/s"]) > 0 and float(row["all_gather KiB"]) > 0
    zero1, muon, fsdp = table
    assert float(zero1["reduce_scatter KiB"]) > 0 and float(fsdp["reduce_scatter KiB"]) > 0
    # Muon's pieces to their owners and back (the tensor-parallel group's all_to_all_v); nothing of it without Muon
    assert float(muon["all_to_all_v KiB"]) > 0 and float(zero1["all_to_all_v KiB"]) == 0
    assert "tp 2 x dp 2 FSDP2" in (tmp_path / "benchmark_training.md").read_text()


def test_context_parallel_benchmark_recipe_compares_tp_with_tp_times_cp(tmp_path):
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark_context_parallel.py"), "vocab_size=64", "hidden=32",
           "heads=8", "kv_heads=4", "s=128", "iters=1", "warmup=0", "s_min=64", "s_max=512", "budget_mib=1",
           f"out={tmp_path}"]
    run_job(cmd, tmp_path, timeout=400)
    with open(tmp_path / "benchmark_context_parallel.csv") as f:
        table = {r["layout"]: r for r in csv.DictReader(f)}
    assert list(table) == ["tp 4", "tp 2 x cp 2 ring", "tp 2 x cp 2 all_to_all"]
    assert float(table["tp 2 x cp 2 ring"]["ring_send KiB"]) > 0 and float(table["tp 4"]["ring_send KiB"]) == 0
    assert float(table["tp 2 x cp 2 all_to_all"]["all_to_all KiB"]) > 0
    for layout in ("tp 2 x cp 2 ring", "tp 2 x cp 2 all_to_all"):  # the s² term is gone: less kept, longer s
        assert float(table[layout]["kept MiB/rank"]) < float(table["tp 4"]["kept MiB/rank"])
        assert int(table[layout]["longest s in budget"]) > int(table["tp 4"]["longest s in budget"])


def test_pipeline_benchmark_recipe_prices_each_schedule_s_trace(tmp_path):
    """pp 2 × tp 2: the executed traces give 1F1B's, ZB-H1's, ZB-V's and DualPipeV's bubbles under the cost model, the
    split schedules move the weight gradients without adding a tensor-parallel collective or a FLOP, no rank of ZB-H1's
    or ZB-V's holds more than 1F1B's first beyond one send in flight (DualPipeV: one chunk micro-batch more than ZB-V,
    2p + 1 of 2p), and each rank's host time is broken down by segment."""
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark_pipeline.py"), "pp=[2]", "tp=2", "n_layer=4",
           "n_embd=32", "n_head=4", "s=32", "vocab_size=64", "global_batch=4", "num_microbatches=4", "iters=1",
           "warmup=0", f"out={tmp_path}"]
    run_job(cmd, tmp_path, timeout=400)
    with open(tmp_path / "benchmark_pipeline.csv") as f:
        table = {r["schedule"]: r for r in csv.DictReader(f)}
    assert set(table) == {"1F1B", "ZB-H1", "ZB-V", "DualPipeV"}
    one, zb, v, dual = table["1F1B"], table["ZB-H1"], table["ZB-V"], table["DualPipeV"]
    # (p − 1)/(m + p − 1), /(3m + p − 1), /(6m + p − 1) twice
    assert (one["bubble F=B=W"], zb["bubble F=B=W"], v["bubble F=B=W"], dual["bubble F=B=W"]) == \
        ("20.0%", "7.7%", "4.0%", "4.0%")
    assert one["tp collectives"] == zb["tp collectives"] == v["tp collectives"] == dual["tp collectives"] != "0"
    assert one["sends/step"] == zb["sends/step"] and int(v["sends/step"]) == 2 * int(one["sends/step"])  # 2 cross ranks
    assert dual["sends/step"] == v["sends/step"]
    # DualPipeV: 2p + 1 chunk micro-batches of ZB-V's 2p, and a stage output it sent held until its batch is waited
    # for (the transfers overlap the actions after them): one [s, b/m, h] float32 tensor, 4 KiB here
    sent = 32 * 1 * 32 * 4 / 1024
    for v_peak, dual_peak in zip(v["peak KiB per rank"].split(" / "), dual["peak KiB per rank"].split(" / ")):
        assert int(v_peak) < int(dual_peak) <= int(v_peak) * 5 / 4 + sent + 1
    first = int(one["peak KiB per rank"].split(" / ")[0])
    for split in (zb, v):  # at most one sent stage output beyond: gloo's worker may still hold a finished send's
        # tensor when the next action peaks (seen on a loaded machine; on an idle one the peaks are equal)
        assert all(int(b) <= first + sent for b in split["peak KiB per rank"].split(" / "))
        assert float(split["tokens/s"]) > 0
    # the same work under every schedule (torch's FLOP counter over the first step, all ranks), and where each rank's
    # host time went: a row per schedule and pipeline rank, F, B (and W where split) timed
    assert len({r["GFLOP/step"] for r in table.values()}) == 1 and float(one["GFLOP/step"]) > 0
    with open(tmp_path / "benchmark_pipeline_actions.csv") as f:
        actions = list(csv.DictReader(f))
    assert [(r["schedule"], r["pp rank"]) for r in actions] == [(f"{name} pp 2", rank) for name in table
                                                              for rank in "01"]
    for r in actions:
        assert float(r["F"]) > 0 and float(r["B"]) > 0 and (float(r["W"]) > 0) == (not r["schedule"].startswith("1F1B"))


def test_generate_benchmark_recipe_counts_each_layout_s_cache_and_collectives(tmp_path):
    """Every layout generates; rank 0's cache holds its a_kv/t heads of its stage's layers; a decoded token costs,
    over tp, one all-reduce per layer's attention (the experts reduce nothing over tp) beside the embedding's, the
    logits' all-gather and the token's broadcast, and at ep 2 a dispatch and a combine per layer."""
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark_generate.py"), "vocab_size=64", "hidden=32", "heads=4",
           "kv_heads=2", "experts=4", "expert_width=16", "layers=2", "b=2", "s=8", "n=3", "iters=1",
           f"out={tmp_path}"]
    run_job(cmd, tmp_path, timeout=400)
    with open(tmp_path / "benchmark_generate.csv") as f:
        table = {r["layout"]: r for r in csv.DictReader(f)}
    assert list(table) == ["transformers generate (1 process)", "tp 1 (1 process)", "tp 2 (2 processes)",
                           "pp 2 (2 processes)", "tp 2 x ep 2 (4 processes)"]
    for row in table.values():  # (speeds are the benchmark's to print, not a test's to bound)
        assert all(math.isfinite(float(row[k])) for k in ("prefill tokens/s", "decode tokens/s"))
    whole = 2 * 2 * 2 * (8 + 3 - 1) * 8 * 4 * 2 / 1024  # K and V, b, a_kv, positions, d, float32, layers: KiB
    assert [float(table[k]["cache KiB (rank 0)"]) for k in table] == [round(whole)] * 2 + [round(whole / 2)] * 3
    assert table["tp 2 (2 processes)"]["collectives per decoded token"] == "1 all_gather, 3 all_reduce, 1 broadcast"
    assert table["pp 2 (2 processes)"]["collectives per decoded token"] == "1 pipeline send"
    assert table["tp 2 x ep 2 (4 processes)"]["collectives per decoded token"] == (
        "1 all_gather, 3 all_reduce, 2 all_to_all (ep), 4 all_to_all_v (ep), 1 broadcast")
