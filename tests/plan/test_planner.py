"""The planner at full size on CPU: real configs inventoried on the meta device (their parameter counts, every rank's
share), every feasibility rule triggered, the records and the command line."""

from __future__ import annotations

import collections
import json
import re

import pytest
import torch

from lightning_seqpar import Layout
from lightning_seqpar.plan import Hardware, LayoutRecord, model_inventory, plan, state_bytes
from lightning_seqpar.plan.__main__ import main
from lightning_seqpar.plan.pricing.rules import layout_rule as _rule
from lightning_seqpar.plan.pricing.state import held_entries, stage_layout

# Published configs, written here (nothing is downloaded).
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 tie_word_embeddings=False)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
QWEN3_32B = dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                 num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, tie_word_embeddings=False)
# The parameter counts their model cards state.
PUBLISHED = {"llama3-8b": (LLAMA3_8B, 8_030_261_248), "llama3-70b": (LLAMA3_70B, 70_553_706_496),
             "qwen3-32b": (QWEN3_32B, 32_762_123_264)}


@pytest.fixture(scope="module")
def inventories():
    return {name: model_inventory(config) for name, (config, _) in PUBLISHED.items()}


@pytest.mark.parametrize("name", PUBLISHED)
def test_real_configs_are_counted_exactly_and_every_rank_s_share_adds_up(inventories, name):
    inventory, total = inventories[name], PUBLISHED[name][1]
    assert inventory.num_parameters == total
    for tp, pp, vpp in [(1, 1, 1), (8, 1, 1), (4, 4, 1), (8, 8, 1), (2, 4, 2), (8, 16, 1)]:
        if inventory.num_layers % (pp * vpp):
            continue
        layout = stage_layout(inventory, pp, vpp)
        # Summed over the t ranks of every stage: each split parameter once (the vocabulary with its padding rows),
        # each replicated one t times, and what every stage holds p times.
        held = sum(e.local_numel(tp) * tp for rank in range(pp) for e in held_entries(inventory, layout, rank))
        padding = (-(-inventory.vocab_size // tp) * tp - inventory.vocab_size) * inventory.hidden_size * 2
        replicated = sum(e.numel for e in inventory.entries if e.split == "replicated") * (tp - 1)
        assert held == total + padding + replicated, (tp, pp, vpp)
        first = state_bytes(inventory, tp, pp, 1, pipeline_rank=0, vpp=vpp, precision="bf16-true")
        assert first.parameters == 2 * sum(e.local_numel(tp) for e in held_entries(inventory, layout, 0))


def test_the_vocabulary_is_padded_to_a_multiple_of_t_on_the_first_and_last_stage_only(inventories):
    inventory = inventories["llama3-8b"]
    layout = stage_layout(inventory, 4)
    names = [{e.name for e in held_entries(inventory, layout, rank)} for rank in range(4)]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[3]
    assert not {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} & (names[1] | names[2])
    embedding = next(e for e in inventory.entries if e.name == "model.embed_tokens.weight")
    assert embedding.local_numel(3) == 42752 * 4096  # ceil(128256 / 3) rows


def _record(dp: int = 1, micro_batch: int = 1, **layout) -> LayoutRecord:
    return LayoutRecord(Layout(**{"recompute": "selective", **layout}), dp, micro_batch)


@pytest.mark.parametrize("layout, seq_len, batch, reason", [
    (dict(tp=16), 8192, 512, "tp=16 spans nodes (8 GPUs per node)"),
    (dict(tp=8), 8192, 512, None),
    (dict(tp=3), 8192, 512, "heads=64 not divisible by tp=3"),
    (dict(pp=3), 8192, 512, "layers=80 not divisible by pp·vpp=3"),
    (dict(dp=3), 8192, 512, "global_batch=512 not divisible by dp·micro_batch=3"),
    (dict(pp=8, dp=64), 8192, 512, None),  # 8 micro-batches for 8 stages
    (dict(pp=8, dp=128), 8192, 512, "micro-batches=4 < pp=8: stages would idle"),
    (dict(pp=4, virtual_stages=2, dp=16, micro_batch=2), 8192, 192, "micro-batches=6 not divisible by pp=4"),
    (dict(tp=8), 8190, 512, "seq_len=8190 not divisible by tp=8"),
])
def test_each_rule_rejects_with_its_reason(inventories, layout, seq_len, batch, reason):
    got = _record(**layout)
    found = _rule(got, inventories["llama3-70b"], seq_len, batch, Hardware())
    assert (found is None) if reason is None else (found is not None and found.startswith(reason)), found


@pytest.mark.parametrize("layout, seq_len, reason", [
    (dict(tp=4, cp=2, recompute="none"), 8192, None),
    (dict(tp=4, cp=2, recompute="none"), 8200, "seq_len=8200 not divisible by 2·cp·tp=16"),
    (dict(tp=4, cp=2), 8192, "selective recomputation has nothing to recompute under cp"),
    (dict(tp=8, cp=2, recompute="none", cp_comm="all_to_all"), 8192, None),  # 8 heads, 1 kv head per tp rank
    (dict(tp=8, cp=2, recompute="none", cp_comm="all_to_all"), 8192, "heads=64/kv_heads=8 per tensor-parallel rank"),
])
def test_context_parallel_rules_reject_with_their_reason(inventories, layout, seq_len, reason):
    inventory = inventories["llama3-8b" if reason is None and layout.get("cp_comm") else "llama3-70b"]
    if layout.get("cp_comm") and reason is None:  # Llama-3-8B: 32 heads, 8 kv heads: 4 and 1 per rank of tp 8
        reason = "heads=32/kv_heads=8 per tensor-parallel rank"
    found = _rule(_record(**layout), inventory, seq_len, 512, Hardware())
    assert (found is None) if reason is None else (found is not None and found.startswith(reason)), found


def test_the_search_covers_context_parallel_sizes_and_a_context_parallel_rank_holds_its_share(inventories):
    inventory = inventories["llama3-8b"]
    records = plan(inventory, 8, 32768, 8, calibrate=False, micro_batches=(1,))
    assert {r.layout.cp for r in records} == {1, 2, 4, 8}
    assert {r.layout.cp for r in plan(inventory, 8, 32768, 8, calibrate=False, micro_batches=(1,),
                               context_parallel=(1,))} == {1}
    by_layout = {(r.layout.tp, r.layout.cp, r.layout.pp, r.dp, r.layout.zero, r.layout.recompute): r for r in records}
    # At s 32768 on 80 GB only layouts with cp fit: the explicit core attention's b·(a/t)·s² temporaries sink the rest
    fits = [r for r in records if r.feasible]
    assert fits and all(r.layout.cp > 1 for r in fits), [(r.layout.tp, r.layout.cp) for r in fits]
    ring, plain = by_layout[(4, 2, 1, 1, 0, "none")], by_layout[(4, 1, 1, 2, 0, "none")]
    assert ring.collective_bytes["context"] > 0 == plain.collective_bytes["context"]
    # ZeRO shards the optimizer over the d·c ranks of the data group: a cp 2 rank holds what a dp 2 rank holds
    sharded = by_layout[(4, 2, 1, 1, 1, "none")]
    assert sharded.bytes["optimizer"] == by_layout[(4, 1, 1, 2, 1, "none")].bytes["optimizer"]
    assert sharded.bytes["optimizer"] < by_layout[(4, 2, 1, 1, 0, "none")].bytes["optimizer"]
    # A cp 2 rank's activations are those of its s/2 tokens: less than tp 4's at the whole sequence, more than tp 8's
    assert by_layout[(8, 1, 1, 1, 0, "full")].bytes["activations"] < ring.bytes["activations"] \
        < by_layout[(4, 1, 1, 2, 0, "none")].bytes["activations"]


def test_selective_recomputation_is_not_offered_with_fused_attention():
    fused = model_inventory(LLAMA3_8B, attention="sdpa")
    assert _rule(_record(tp=8), fused, 8192, 512, Hardware()) == (
        "selective recomputation has nothing to recompute in fused attention (sdpa keeps no s² tensor)")
    assert _rule(_record(tp=8, recompute="full"), fused, 8192, 512, Hardware()) is None


def test_key_value_heads_and_the_mlp_width_are_checked_too(inventories):
    assert _rule(_record(tp=16), inventories["qwen3-32b"], 8192, 512, Hardware(gpus_per_node=16)) == \
        "kv_heads=8 not divisible by tp=16"
    assert _rule(_record(tp=8), model_inventory(dict(LLAMA3_8B, intermediate_size=14340)), 8192, 512, Hardware()) \
        == "ffn=14340 not divisible by tp=8"


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_layouts_are_ranked_feasible_first_and_memory_rejections_name_the_bytes(inventories):
    records = plan(inventories["llama3-70b"], 64, 8192, 512, hardware=Hardware(memory=80e9), calibrate=False)
    feasible = [r for r in records if r.feasible]
    assert feasible and all(r.bytes["total"] <= 0.8 * 80e9 for r in feasible)
    times = [r.step_time["total"] for r in feasible]
    assert times == sorted(times)
    assert records[:len(feasible)] == feasible
    too_big = [r for r in records if not r.feasible and r.bytes]
    assert too_big and all(r.reason.startswith("needs ") and "> 0.8 × 80 GB on stage" in r.reason for r in too_big)
    assert any(r.layout.tp == 1 and r.layout.pp == 1 for r in too_big)  # 70B unsplit on 80 GB cannot fit
    best = feasible[0]
    assert best.bytes["total"] == sum(v for k, v in best.bytes.items() if k != "total")
    assert set(best.step_time) == {"compute", "tensor", "data", "pipeline", "expert", "context", "bubble", "total"}
    assert best.step_time["expert"] == best.collective_bytes["expert"] == 0.0  # no experts


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_command_line_prints_the_table_and_the_json_records(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    assert main([str(config), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--top", "3",
                 "--analytic"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM: 8.03 B parameters" in out
    assert [line.split(" | ")[0] for line in out.splitlines() if re.match(r"\| \d+ \| ", line)] == ["| 1", "| 2", "| 3"]
    assert "Rejected:" in out
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--json",
                 "--analytic"]) == 0
    records = json.loads(capsys.readouterr().out)
    keys = {"layout", "dp", "micro_batch", "feasible", "reason", "bytes"}
    assert records and all(keys <= set(r) for r in records)
    assert all(Layout(**r["layout"]).pp == r["layout"]["pp"] for r in records)  # each row's Layout, as given back
    assert {r["feasible"] for r in records} == {True, False}
    assert all((r["reason"] is None) == r["feasible"] for r in records)
    parts = {"parameters", "gradients", "main_params", "optimizer", "activations", "other", "total"}
    assert all(set(r["bytes"]) == parts for r in records if r["feasible"])
    assert {r["layout"]["cp"] for r in records} == {1, 2, 4, 8}
    assert {r["layout"]["cp_comm"] for r in records} == {"ring"}
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--json", "--analytic",
                 "--cp", "1", "2", "--cp-comm", "all_to_all"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["layout"]["cp"] for r in records} == {1, 2}
    assert {r["layout"]["cp_comm"] for r in records if r["layout"]["cp"] == 2} == {"all_to_all"}
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--json", "--analytic",
                 "--cp", "1", "--schedule", "ZB-H1"]) == 0
    piped = [r for r in json.loads(capsys.readouterr().out) if r["feasible"] and r["layout"]["pp"] > 1]
    # ZB-H1's, F = B = W
    third = [r["bubble"] / ((r["layout"]["pp"] - 1) / (3 * r["layout"]["num_microbatches"])) for r in piped]
    # (under full recomputation B makes the forward again: a heavier B idles more)
    assert piped and all(r["layout"]["virtual_stages"] == 1 for r in piped)
    assert all(x == pytest.approx(1.0) if r["layout"]["recompute"] != "full" else x > 1.0 for r, x in zip(piped, third))
    with pytest.raises(FileNotFoundError, match="neither a config.json"):
        main([str(tmp_path / "missing"), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32"])


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_calibrated_activations_come_from_the_model_s_own_layer():
    from lightning_seqpar.plan.measuring.fits import ProbedMeasurements
    from lightning_seqpar.plan.measuring.probe import fit_layer, fit_outside
    from lightning_seqpar.plan.planner import _evaluate

    tiny = dict(LLAMA3_8B, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    inventory = model_inventory(tiny)
    record = _record(tp=2, dp=1)
    _rule(record, inventory, 512, 8, Hardware())
    _evaluate(record, inventory, 512, 8, Hardware(), "bf16-mixed", 0.8, "1F1B", False, measured=ProbedMeasurements({}))
    fit = fit_layer(inventory.config, 2, True, "selective", "bf16-mixed")
    per_layer = fit.bytes(512, 1, inventory.head_dim, inventory.ffn_hidden_size)
    # under the record's recomputation: a checkpointed attention keeps the prologue's mask
    outside = fit_outside(inventory.config, 2, True, "bf16-mixed", recompute=record.layout.recompute).bytes(
        512, 1, inventory.head_dim, 1000)
    assert outside > 4 * 512 * 1000 / 2  # at least a float32 copy of the logits shard
    # pp 1: one micro-batch in flight, less its logits ([s·b, v/t], 16-bit), which live from the head to the end of the
    # loss's forward only (the loss keeps its float32 softmax)
    assert record.bytes["activations"] == int(4 * per_layer + outside - 2 * 512 * 1000 / 2)


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_command_line_probes_the_model_by_default(tmp_path, capsys):
    tiny = dict(LLAMA3_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    assert main([str(tmp_path), "--gpus", "2", "--seq-len", "256", "--global-batch", "4", "--gpu-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "activations measured on small copies of it and scaled" in out and "| 1 |" in out


@pytest.mark.parametrize("name, tp, pp, vpp", [
    ("llama3-8b", 8, 1, 1), ("llama3-8b", 8, 4, 1), ("llama3-8b", 4, 4, 2), ("llama3-8b", 2, 8, 2),
    ("llama3-70b", 8, 8, 1), ("llama3-70b", 8, 4, 5), ("llama3-70b", 4, 16, 1), ("llama3-70b", 8, 2, 1),
    ("qwen3-32b", 8, 8, 1), ("qwen3-32b", 4, 4, 2), ("qwen3-32b", 8, 16, 1), ("qwen3-32b", 2, 2, 1),
])
def test_full_size_ranks_built_on_the_meta_device_hold_the_predicted_parameters(inventories, name, tp, pp, vpp):
    # The strategy's own rewrite, stage split and placement at the real size: the first, a middle and the last
    # pipeline rank, on the last tensor rank (which holds the vocabulary's padding rows; every tensor rank holds as
    # many elements).
    from lightning_seqpar.plan.measuring.dry_run import dry_run

    config = PUBLISHED[name][0]
    for pipeline_rank in sorted({0, pp // 2, pp - 1}):
        built = dry_run(config, inventories[name], Layout(tp=tp, pp=pp, virtual_stages=vpp), pipeline_rank,
                        "bf16-true", tp - 1)
        assert built.measured == built.predicted, pipeline_rank


@pytest.mark.parametrize("schedule", ["ZB-V", "DualPipeV"])
def test_the_dry_run_builds_the_v_placement_a_zero_bubble_layout_is_priced_at(inventories, schedule):
    # Stages 0 and 7 on pipeline rank 0 of 4 (the embedding and the head), 3 and 4 on rank 3, against the loop's 0
    # and 4, 3 and 7: the same layers, the head (and final norm) moved from the last rank to the first.
    from lightning_seqpar.plan.measuring.dry_run import dry_run

    config, inventory = PUBLISHED["llama3-8b"][0], inventories["llama3-8b"]
    head = (128256 // 8 * 4096 + 4096) * 2  # bf16: a tensor rank's head rows and the final norm
    built = {(name, rank): dry_run(config, inventory, Layout(tp=8, pp=4, virtual_stages=2, schedule=name), rank,
                                   "bf16-true", 7)
             for name in (schedule, "1F1B") for rank in (0, 3)}
    assert all(run.measured == run.predicted for run in built.values())
    assert built[schedule, 0].measured - built["1F1B", 0].measured == head
    assert built["1F1B", 3].measured - built[schedule, 3].measured == head


def test_the_dry_run_of_the_planner_s_best_zero_bubble_record_builds_its_v(inventories):
    # The record's own Layout, as the command line's --dry-run takes it: built at its schedule and stage placement
    from lightning_seqpar.plan.measuring.dry_run import dry_run

    config, inventory = PUBLISHED["llama3-8b"][0], inventories["llama3-8b"]
    records = plan(inventory, 32, 4096, 64, hardware=Hardware(memory=80e9), calibrate=False, context_parallel=(1,),
                   schedule=("1F1B", "ZB-V"), micro_batches=(1,))
    best = next(r for r in records if r.feasible and r.layout.pp > 1)
    assert best.layout.schedule == "ZB-V"  # at these sizes the V wins the ranking
    loop = best.layout.replace(schedule="1F1B")  # the same sizes in the loop placement (interleaved, v 2)
    last = best.layout.pp - 1
    v, looped = (dry_run(config, inventory, lay, 0, "bf16-true") for lay in (best.layout, loop))
    assert v.measured == v.predicted and looped.measured == looped.predicted
    tp = best.layout.tp
    head = (-(-128256 // tp) * 4096 + 4096) * 2  # rank 0 of the V holds the head and the final norm too
    assert v.measured - looped.measured == head
    assert dry_run(config, inventory, best.layout, last, "bf16-true").measured == \
        dry_run(config, inventory, loop, last, "bf16-true").measured - head


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_command_line_dry_run_prints_every_pipeline_rank(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main([str(tmp_path), "--gpus", "32", "--seq-len", "8192", "--global-batch", "64", "--gpu-memory", "40GB",
                 "--top", "1", "--analytic", "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  pipeline rank ")]
    assert lines and all("DIFFERENT" not in line for line in lines)
    assert "built on the meta device" in out


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_command_line_dry_run_builds_the_schedule_the_best_layout_runs(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    assert main([str(tmp_path), "--gpus", "32", "--seq-len", "4096", "--global-batch", "64", "--gpu-memory", "80GB",
                 "--top", "1", "--analytic", "--schedule", "ZB-V", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pp 4, vpp 2, ZB-V), built on the meta device" in out
    lines = [line for line in out.splitlines() if line.startswith("  pipeline rank ")]
    assert len(lines) == 4 and all("DIFFERENT" not in line for line in lines)


def _muon(model):
    from lightning_seqpar.optim import Muon

    return Muon(Muon.groups(model), lr=0.1)


@pytest.mark.parametrize("name, make", [
    ("sgd", lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
    ("adamw", lambda model: torch.optim.AdamW(model.parameters(), lr=0.1)),
    ("muon", _muon),  # momentum on the layers' matrices; AdamW's two states and a step on the rest
])
def test_the_optimizer_s_state_is_what_it_keeps_after_a_step(name, make):
    from lightning_seqpar.plan import inventory_of_hf_model
    from tests.helpers.models import SEQ, VOCAB, build

    module = build("hf", labels=True)
    optimizer = make(module.model)
    x = torch.randint(0, VOCAB, (2, SEQ))
    module.model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    held = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))
    predicted = state_bytes(inventory_of_hf_model(module.model), 1, precision="32-true", optimizer=name)
    assert predicted.optimizer == held
    if name != "muon":
        assert predicted.temporary == (predicted.parameters if name == "adamw" else 0)  # exp_avg_sq.sqrt(); SGD none


def test_muon_is_planned_with_its_orthogonalisation_in_the_step(inventories):
    records = plan(inventories["llama3-8b"], 16, 4096, 64, hardware=Hardware(memory=1e15), calibrate=False,
                   optimizer="muon")
    feasible = [r for r in records if r.feasible]
    assert feasible and all(r.step_time["newton_schulz"] > 0 for r in feasible)
    # a rank runs 1/t of its matrices' orthogonalisations (1/(t·d) under zero=1): the time falls with t at equal pp
    by_tp = {r.layout.tp: r.step_time["newton_schulz"] for r in feasible
             if r.layout.pp == 1 and r.layout.cp == 1 and not r.layout.zero}
    assert len(by_tp) > 1 and all(by_tp[a] > by_tp[b] for a in by_tp for b in by_tp if a < b)
    pairs = [(a, b) for a in feasible for b in feasible
             if (a.layout.replace(zero=1, fp32_main_params=b.layout.fp32_main_params), a.dp, a.micro_batch)
             == (b.layout, b.dp, b.micro_batch) and a.layout.zero == 0 and a.dp > 1]
    assert pairs and all(b.step_time["newton_schulz"] < a.step_time["newton_schulz"] for a, b in pairs)
    assert all(b.bytes["optimizer"] < a.bytes["optimizer"] for a, b in pairs)  # the state over the data-parallel ranks
    assert all((r.step_time["muon_exchange"] > 0) == (r.layout.tp > 1 or bool(r.layout.zero)) for r in feasible)


def test_an_unknown_optimizer_is_refused_by_name(inventories):
    with pytest.raises(ValueError, match="optimizer='lion': one of"):
        plan(inventories["llama3-8b"], 8, 4096, 32, optimizer="lion", calibrate=False)


def test_other_bytes_name_what_they_are(inventories):
    records = [r for r in plan(inventories["llama3-8b"], 16, 4096, 64, hardware=Hardware(memory=1e15),
                               calibrate=False) if r.feasible]
    assert all(sum(r.other.values()) == r.bytes["other"] for r in records)
    accumulating = next(r for r in records if r.dp > 1 and r.layout.zero == 0 and r.layout.num_microbatches > 1)
    # bf16-mixed keeps float32 parameters: the earlier micro-batches' .grad beside the buckets is one of each
    assert accumulating.other["accumulated_gradients"] == accumulating.bytes["parameters"]
    named = set().union(*(r.other for r in records))
    assert {"forward", "loss_forward", "backward", "accumulated_gradients", "optimizer"} >= named
    assert "forward" in named  # s 4096, tp ≤ 8: the end of a forward peaks in some layout (eager core attention)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "llama"}, r"config.json: no 'num_hidden_layers'; a plan needs the model's num_hidden_layers, "
                              r"hidden_size, num_attention_heads, vocab_size"),
    (dict(LLAMA3_8B, hidden_size=None), r"config.json: hidden_size = None; it must be a positive integer"),
    (dict(LLAMA3_8B, num_hidden_layers=0), r"num_hidden_layers = 0; it must be a positive integer"),
    (dict(LLAMA3_8B, vocab_size=-5), r"vocab_size = -5; it must be a positive integer"),
    (dict(LLAMA3_8B, num_hidden_layers=1_000_000_000), r"num_hidden_layers = 1,000,000,000; no model has more than"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 100}, r"no 'num_hidden_layers' \(or 'n_layer'\)"),
])
def test_a_config_missing_or_misstating_a_size_is_refused_by_name(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic"])


@pytest.mark.parametrize("flag, value", [("--gpus", "0"), ("--gpus", "1000000000"), ("--seq-len", "0"),
                                         ("--global-batch", "-1"), ("--gpus", "eight")])
def test_counts_out_of_range_are_refused_at_once_naming_the_flag(tmp_path, capsys, flag, value):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = {"--gpus": "8", "--seq-len": "4096", "--global-batch": "32", flag: value}
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path), *[x for kv in args.items() for x in kv], "--analytic"])
    assert exited.value.code == 2 and f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_default_output_is_short_and_says_what_would_fit_when_nothing_does(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    base = [str(tmp_path), "--gpus", "8", "--seq-len", "65536", "--global-batch", "8", "--analytic"]
    assert main(base + ["--gpu-memory", "40GB"]) == 0
    out = capsys.readouterr().out
    # (a line per rule and per change that would fit: no layout listed one by one)
    assert len(out.splitlines()) < 26 and max(map(len, out.splitlines()[1:])) < 300
    assert "8 × GPU (h100's rates: --gpu to set them) (40 GB" in out and "× h100" not in out
    rules = [line for line in out.splitlines() if re.match(r"- \d+ × ", line)]
    assert len(rules) == len({line.split(" (e.g.")[0] for line in rules}) >= 2  # one line per rule
    assert re.search(r"- \d+ × too large for the GPU \(the smallest: .*needs [\d.]+ GB > 0.8 × 40 GB", out)
    assert "No layout fits. What would:\n- GPUs of at least " in out
    # every change planned again, with the figure it gives: more GPUs (the s² scores divide over tp 16), a precision,
    # LoRA, memory choices, the fused kernel, a shorter sequence
    assert re.search(r"- --gpus (16|32|64): tp\d+ (cp\d+ )?pp\d+.* fits \([\d.]+ GB\)", out)
    for flag in ("--precision bf16-true (16-bit parameters", "--lora 16 (the base frozen", "--memory-choices (the MLP",
                 "--attention sdpa (no s² probabilities kept)"):
        assert re.search(rf"- {re.escape(flag)}.*: (tp\d+ pp\d+.* fits|does not fit either \((the smallest"
                         rf"( whose model state fits)?|no layout's model state fits: the least), .* needs)"
                         rf" ?\(?[\d.]+ GB\)", out), flag
    # The first shorter sequence that fits: 32768 does not (the eager core attention alone makes 11 to 13 bytes of
    # temporaries per score, b·a/t·s² = 4·32768² scores at tp 8), a quarter or an eighth of 65536 does.
    assert "--seq-len 32768" not in out
    assert re.search(r"- --seq-len (16384|8192): tp\d+ pp\d+.* fits", out)
    assert re.search(r"\nAnswered in [\d.]+ s", out)
    assert main(base + ["--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert "(e.g." not in verbose and len(verbose.splitlines()) > len(out.splitlines())


def test_zb_h1_layouts_take_a_third_of_the_bubble_and_the_first_rank_s_peak(inventories):
    """ZB-H1 (B/W split): the bubble over compute is (p − 1)/(3m) where 1F1B's is (p − 1)/m; the first stage's peak
    is 1F1B's; interleaved layouts are refused for it by name."""
    options = dict(hardware=Hardware(memory=1e12), calibrate=False)
    def key(r):
        return r.layout.replace(schedule="1F1B", num_microbatches=None), r.dp, r.micro_batch

    one_f_one_b = {key(r): r for r in plan(inventories["llama3-8b"], 16, 4096, 64, **options)
                   if r.feasible and r.layout.pp > 1}
    zb = plan(inventories["llama3-8b"], 16, 4096, 64, schedule="ZB-H1", **options)
    checked = 0
    assert any(r.reason == f"ZB-H1 runs one model chunk per rank (vpp={r.layout.virtual_stages})" for r in zb)
    for r in zb:
        if r.layout.pp > 1 and r.layout.virtual_stages > 1:
            assert not r.feasible
            continue
        base = one_f_one_b.get(key(r))
        if base is None or not r.feasible:
            continue
        m = r.layout.num_microbatches
        assert base.bubble == pytest.approx((r.layout.pp - 1) / m)
        if r.layout.recompute == "full":  # B makes the forward again first: a heavier B idles more than a third
            assert base.bubble > r.bubble > (r.layout.pp - 1) / (3 * m)
        else:
            assert r.bubble == pytest.approx((r.layout.pp - 1) / (3 * m))
        # every stage holds p micro-batches from F to W, those past their B only what W reads (its linears' inputs
        # and output gradients), and a B makes no weight gradient: until a stage's first W its weights have no .grad.
        # So the first stage's peak is at most 1F1B's (less by at most the gradients), a later one's may pass it.
        assert r.bytes["total"] >= base.bytes["total"] - base.bytes["gradients"]
        if r.stage == base.stage == 0:
            assert r.bytes["total"] <= base.bytes["total"]
        assert r.step_time["total"] < base.step_time["total"]
        checked += 1
    assert checked >= 3


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_loss_in_chunks_keeps_no_logits_and_the_command_line_sets_it(tmp_path, capsys):
    # Llama-3-8B at s 16384, tp 8: 16384 positions a rank, past the strategy's default chunk of 4096. Whole, a
    # micro-batch keeps the softmax [s·b, v/t] in float32 until its backward; in chunks, nothing of the logits.
    # (fused attention: no s² scores to make the peak elsewhere)
    inventory = model_inventory(LLAMA3_8B, 16384, "sdpa")
    options = dict(hardware=Hardware(memory=1e15), calibrate=False, context_parallel=(1,), schedule="1F1B")
    chunked, whole = ({(r.layout.tp, r.layout.pp, r.layout.virtual_stages, r.micro_batch, r.layout.recompute,
                        r.layout.zero): r for r in plan(inventory, 8, 16384, 8, loss_chunk=chunk, **options)}
                      for chunk in (4096, None))
    key = (8, 1, 1, 1, "none", 0)
    assert chunked[key].layout.loss_chunk == 4096 and whole[key].layout.loss_chunk is None
    softmax = 4 * 16384 * 128256 / 8
    assert whole[key].bytes["total"] - chunked[key].bytes["total"] > softmax
    # and pays for it with the head's GEMM made again in backward: 2·B·s·h·v FLOPs a step
    assert chunked[key].flops["hardware"] - whole[key].flops["hardware"] == 2 * 8 * 16384 * 4096 * 128256
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    for values, expected in ((["none"], {None}), (["2048"], {2048}), (["2048", "none"], {2048, None})):
        assert main([str(tmp_path), "--gpus", "8", "--seq-len", "8192", "--global-batch", "8", "--analytic", "--json",
                     "--loss-chunk", *values, "--cp", "1"]) == 0
        records = json.loads(capsys.readouterr().out)
        assert {r["layout"]["loss_chunk"] for r in records} == expected
    # searched: a layout split over tp (its loss rewritten; 8192 positions a rank, past 2048) is priced twice; one
    # that is not (transformers' own loss, whole either way) once
    priced = collections.Counter((*(r["layout"][k] for k in ("tp", "pp", "virtual_stages")), r["micro_batch"],
                                  *(r["layout"][k] for k in ("recompute", "zero", "schedule"))) for r in records)
    assert priced[(8, 1, 1, 1, "none", 0, "1F1B")] == 2 and priced[(1, 8, 1, 1, "none", 0, "1F1B")] == 1
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "8192", "--global-batch", "8", "--analytic",
                 "--loss-chunk", "2048", "none", "--cp", "1"]) == 0
    assert "| loss chunk |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--gpus", "8", "--seq-len", "8192", "--global-batch", "8", "--loss-chunk", "0"])


def test_memory_choices_on_the_smallest_layouts_only(inventories):
    # the command line's hint when nothing fits: memory choices tried on the few smallest layouts that allow them
    options = dict(hardware=Hardware(memory=8e9), calibrate=False, memory_choices=True)
    every = plan(inventories["llama3-8b"], 8, 8192, 8, **options)
    few = plan(inventories["llama3-8b"], 8, 8192, 8, memory_choices_on=2, **options)

    def layout(r):
        return r.layout.replace(recompute_modules=(), offload=()), r.dp, r.micro_batch

    plain = [r for r in few if not (r.layout.recompute_modules or r.layout.offload)]
    tried = {layout(r) for r in few if r.layout.recompute_modules or r.layout.offload}
    smallest = sorted((r for r in plain if r.bytes and not r.feasible and r.layout.recompute != "full"),
                      key=lambda r: r.bytes["total"])[:2]
    assert tried == {layout(r) for r in smallest}
    assert len({layout(r) for r in every if r.layout.recompute_modules or r.layout.offload}) > len(tried)
    assert [layout(r) for r in plain] == [layout(r) for r in every
                                          if not (r.layout.recompute_modules or r.layout.offload)]
