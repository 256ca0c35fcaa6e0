"""The planner prices mixtures of experts: Qwen3-30B-A3B counted exactly at full size (its experts split over ep
ranks, whole on each, whatever t is), a full-size rank built on the meta device holding what it predicts, the
expert-parallel size searched with its rules, the all-to-all bytes of the dispatch, and a layer's activations measured
on small copies with the autocast copies of the experts a rank does not hold taken out."""

from __future__ import annotations

import pytest

from lightning_seqpar import Layout
from lightning_seqpar.plan import Hardware, LayoutRecord, model_inventory, plan, state_bytes
from lightning_seqpar.plan.measuring.calibration import Link
from lightning_seqpar.plan.pricing.model_inventory import ExpertShape
from lightning_seqpar.plan.pricing.experts import expert_layer_elements
from lightning_seqpar.plan.measuring.fits import ProbedMeasurements
from lightning_seqpar.plan.pricing.kept import layer_activation_bytes
from lightning_seqpar.plan.pricing.rules import layout_rule as _rule
from lightning_seqpar.plan.measuring.probe import TERMS, fit_layer
from lightning_seqpar.plan.pricing.state import held_entries, stage_layout

# Published config, written here (nothing is downloaded); 30,532,122,624 parameters (its safetensors index).
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], max_position_embeddings=40960, tie_word_embeddings=False)
EXPERTS_PER_LAYER = 128 * 3 * 2048 * 768  # gate, up and down of each expert


@pytest.fixture(scope="module")
def qwen3_moe():
    return model_inventory(QWEN3_30B_A3B)


def _record(dp: int = 1, micro_batch: int = 1, **layout) -> LayoutRecord:
    return LayoutRecord(Layout(**{"recompute": "selective", **layout}), dp, micro_batch)


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_dispatch_pays_a_latency_for_each_all_to_all_it_makes(qwen3_moe):
    """The dropless dispatch exchanges its split counts before its rows (``moe/dispatch.py``): per MoE layer and
    micro-batch five all-to-alls (counts, rows and combine forward, rows and combine backward), eight under full
    recomputation (the forward's three again); their bytes are the four (six) that carry rows."""
    from tests.plan.test_step_time_calibration import calibration

    latency, bandwidth = 1e-3, 1e12
    links = tuple((kind, n, Link(latency, bandwidth)) for kind, n, _ in calibration().collectives)
    records = plan(qwen3_moe, 16, 4096, 64, calibrate=False, micro_batches=(1,),
                   hardware=Hardware(memory=1e15, gpus_per_node=16, calibration=calibration(collectives=links)))
    for recompute, count in (("selective", 5), ("none", 5), ("full", 8)):
        record = next(r for r in records if r.feasible and r.layout.ep > 1 and r.layout.recompute == recompute)
        layers = 48 // record.layout.pp
        assert record.step_time["expert"] == pytest.approx(
            layers * record.layout.num_microbatches * count * latency + record.collective_bytes["expert"] / bandwidth)


def test_the_experts_are_counted_exactly_and_split_over_ep_only(qwen3_moe):
    assert qwen3_moe.num_parameters == 30_532_122_624
    assert qwen3_moe.experts == ExpertShape(num_experts=128, top_k=8, expert_ffn=768)
    assert qwen3_moe.ffn_hidden_size == 8 * 768  # what each token goes through
    experts = [e for e in qwen3_moe.entries if e.expert]
    assert {e.split for e in experts} == {"expert_width"}  # gate/up and down: split along the width under etp
    assert sum(e.numel for e in experts) == 48 * EXPERTS_PER_LAYER == expert_layer_elements(qwen3_moe) * 48
    dense = sum(e.local_numel(4) for e in qwen3_moe.entries if not e.expert)
    for ep in (1, 2, 4, 8, 16):  # tp 4: the experts are not split by t
        got = state_bytes(qwen3_moe, 4, 1, 4, ep=ep, precision="bf16-true").parameters
        assert got == 2 * (dense + 48 * EXPERTS_PER_LAYER // ep), ep
    for ep, etp in ((2, 2), (1, 4), (4, 4)):  # and by expert tensor parallelism, along each expert's width
        got = state_bytes(qwen3_moe, 4, 1, 4, ep=ep, expert_tp=etp, precision="bf16-true").parameters
        assert got == 2 * (dense + 48 * EXPERTS_PER_LAYER // (ep * etp)), (ep, etp)


def test_zero_1_ranges_of_experts_are_over_expert_data_parallel(qwen3_moe):
    # tp 4 · dp 2, ep 2: the experts' replicas are edp = 4 ranks (tensor-parallel peers among them), the dense
    # weights' d = 2: the optimizer state holds 1/4 of the rank's experts and 1/2 of its dense shards.
    layout = stage_layout(qwen3_moe, 1)
    held = held_entries(qwen3_moe, layout, 0)
    experts = sum(e.local_numel(4, 2) for e in held if e.expert)
    dense = sum(e.local_numel(4) for e in held if not e.expert)
    got = state_bytes(qwen3_moe, 4, 1, 2, zero=1, precision="32-true", ep=2)
    assert got.optimizer - got.steps == 2 * 4 * (experts // 4 + sum(-(-e.local_numel(4) // 2) for e in held
                                                                    if not e.expert))
    assert dense % 2 == 0 and experts % 4 == 0


@pytest.mark.parametrize("tp, pp, ep, expert_rank", [(4, 2, 8, 3), (1, 4, 16, 15), (4, 1, 2, 1)])
def test_a_full_size_rank_built_on_the_meta_device_holds_the_predicted_parameters(qwen3_moe, tp, pp, ep, expert_rank):
    from lightning_seqpar.plan.measuring.dry_run import dry_run

    for pipeline_rank in sorted({0, pp - 1}):
        built = dry_run(QWEN3_30B_A3B, qwen3_moe, Layout(tp=tp, pp=pp, ep=ep), pipeline_rank, "bf16-true", tp - 1,
                        expert_rank)
        assert built.measured == built.predicted, pipeline_rank


@pytest.mark.parametrize("layout, reason", [
    (dict(tp=2, dp=4, ep=8), None),
    (dict(tp=1, dp=6, ep=3), "experts=128 not divisible by ep=3"),
    (dict(tp=2, dp=4, ep=16), "ep=16 does not divide tp·cp·dp=8"),
    (dict(tp=4, dp=2, pp=2, ep=8), None),
])
def test_expert_parallel_rules_reject_with_their_reason(qwen3_moe, layout, reason):
    found = _rule(_record(**layout), qwen3_moe, 4096, 64, Hardware())
    assert (found is None) if reason is None else (found is not None and found.startswith(reason)), found


def test_a_shared_expert_is_split_over_tp_and_a_pooled_router_loss_is_planned_under_pipelines():
    qwen2_moe = model_inventory(dict(QWEN3_30B_A3B, model_type="qwen2_moe", shared_expert_intermediate_size=5642,
                                     output_router_logits=True, num_hidden_layers=4, vocab_size=1024))
    assert qwen2_moe.experts.shared_ffn == 5642 and qwen2_moe.ffn_hidden_size == 8 * 768 + 5642
    assert _rule(_record(tp=4, dp=1), qwen2_moe, 4096, 64, Hardware()) == "shared expert ffn=5642 not divisible by tp=4"
    assert _rule(_record(tp=2, pp=2, dp=2, ep=2), qwen2_moe, 4096, 64, Hardware()) is None  # carried between stages
    assert _rule(_record(tp=2, dp=4, ep=8), qwen2_moe, 4096, 64, Hardware()) is None
    dense = model_inventory(dict(QWEN3_30B_A3B, model_type="qwen3", num_hidden_layers=4))
    assert _rule(_record(tp=2, dp=4, ep=2), dense, 4096, 64, Hardware()) == "ep=2 without experts"


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_planner_searches_ep_and_prices_its_all_to_all(qwen3_moe):
    records = plan(qwen3_moe, 16, 4096, 64, hardware=Hardware(), calibrate=False, micro_batches=(1,))
    feasible = [r for r in records if r.feasible]
    assert {r.layout.ep for r in records} == {r.layout.expert_tp for r in records} == {1, 2, 4, 8, 16}
    best = feasible[0].layout if feasible else None
    assert best and best.ep * best.expert_tp > 1  # whole experts on every rank do not fit 80 GB
    assert all(r.layout.ep * r.layout.expert_tp > 1 or r.layout.pp >= 4 for r in feasible)
    assert not any(r.layout.zero and r.layout.expert_tp > 1 for r in records)  # the strategy refuses them together
    # Per micro-batch and MoE layer: n = s·b/t tokens, k pairs each, (e − 1)/e of them to other ranks, h elements
    # of 2 bytes, in the forward's dispatch and combine and the backward's two.
    unbounded = plan(qwen3_moe, 16, 4096, 64, hardware=Hardware(memory=1e15), calibrate=False, micro_batches=(1,))
    same = {r.layout.ep: r for r in unbounded if r.feasible and r.layout.replace(ep=1, num_microbatches=None)
            == Layout(tp=2, pp=2, recompute="selective")}
    assert sorted(same) == [1, 2, 4, 8]  # ep divides t·d = 8
    for ep, record in same.items():
        pairs = 4096 // 2 * 8 * (ep - 1) / ep
        assert record.collective_bytes["expert"] == record.layout.num_microbatches * 24 * 4 * pairs * 2048 * 2
    assert same[1].collective_bytes["expert"] == 0.0
    assert [same[ep].bytes["parameters"] for ep in (1, 2, 4, 8)] == sorted(
        (same[ep].bytes["parameters"] for ep in (1, 2, 4, 8)), reverse=True)
    assert same[8].step_time["expert"] > same[2].step_time["expert"] > 0
    # Under expert tensor parallelism each pair is etp width slices, (e·etp − 1)/(e·etp) of them to other ranks; the
    # rank's experts are 1/etp as wide, so its parameters shrink with e·etp alike.
    width = {(r.layout.ep, r.layout.expert_tp): r for r in unbounded if r.feasible and r.layout.replace(
        ep=1, expert_tp=1, num_microbatches=None) == Layout(tp=2, pp=2, recompute="selective")}
    for (ep, etp), record in width.items():
        pairs = 4096 // 2 * 8 * etp * (ep * etp - 1) / (ep * etp)
        m = record.layout.num_microbatches
        assert record.collective_bytes["expert"] == m * 24 * 4 * pairs * 2048 * 2, (ep, etp)
    assert width[2, 2].bytes["parameters"] == width[4, 1].bytes["parameters"] < width[2, 1].bytes["parameters"]
    # Its activations keep etp times the rows of width h (the experts' input, the combine's pairs): 2·(etp − 1)·
    # s/t·b·k·h·2 bytes more per layer and micro-batch in flight than the same layout's whole experts at the same
    # e·etp (24 layers on the first of 2 stages, 2 micro-batches in flight under 1F1B).
    extra = width[2, 2].bytes["activations"] - width[4, 1].bytes["activations"]
    assert extra == 24 * 2 * 2 * (2 - 1) * (4096 // 2 * 1 * 8) * 2048 * 2


def test_a_mixture_s_layer_is_measured_and_a_rank_of_ep_keeps_its_own_experts_autocast_copies():
    tiny = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    inventory = model_inventory(tiny)
    fits: dict = {}
    probed = ProbedMeasurements(fits)
    one = layer_activation_bytes(_record(tp=2, dp=2), inventory, 256, "bf16-mixed", False, probed)
    four = layer_activation_bytes(_record(tp=2, dp=2, ep=4), inventory, 256, "bf16-mixed", False, probed)
    fit = fits[(inventory.probe_key, 2, "selective", "bf16-mixed")]
    assert fit.check_error < 0.01  # the fit predicts a probe it was not fitted on
    # The probe's d·f term is the 16-bit copies of all E experts autocast keeps for backward (E·3·h·f_e elements,
    # h = a·d and f_e = f·f_e/(k·f_e)), measured; a rank of ep 4 keeps a quarter of them.
    assert fit.coefficients[TERMS.index("df")] == pytest.approx(2 * 8 * 3 * 4 / 2, rel=0.02)
    assert one - four == 2 * expert_layer_elements(inventory) * 3 / 4
    full = fit_layer(inventory.config, 2, True, "full", "32-true", inventory.experts)
    assert full.check_error < 0.01


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_one_cache_of_probes_serves_two_models_without_mixing_their_fits():
    from lightning_seqpar.plan import predict

    dense = model_inventory(dict(QWEN3_30B_A3B, model_type="qwen3", vocab_size=512, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16))
    moe = model_inventory(dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32))
    shared: dict = {}
    for inventory in (dense, moe):
        alone = predict(inventory, _record(tp=2), 128, 4, fits={}).bytes
        assert predict(inventory, _record(tp=2), 128, 4, fits=shared).bytes == alone
    assert len({key[0] for key in shared if key[0] not in ("probe", "probe models")}) == 2
    assert len({key[1] for key in shared if key[0] == "probe"}) == 2  # the probes measured, by the model's config
