"""The planner prices recomputation by module and activation offload (bytes left on the device, bytes moved to the
host, their time, the MLP's recomputed FLOPs), refuses what cannot go together, and, asked to, trades them for memory
on layouts too large for the GPU, saying why."""

from __future__ import annotations

import pytest

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.flops import mlp_forward_flops
from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES
from lightning_seqpar import Layout
from lightning_seqpar.plan import Hardware, LayoutRecord, model_inventory, plan, predict
from lightning_seqpar.plan.pricing.activations import layer_bytes, offloaded_layer_bytes
from lightning_seqpar.plan.pricing.memory_choices import host_traffic

S, BATCH = 8192, 8


@pytest.fixture(scope="module")
def inventory():
    return model_inventory("gpt-22b", S, "eager")


def _predict(inventory, recompute="selective", modules=(), offload=(), tp=8, pp=1, **hardware):
    record = LayoutRecord(Layout(tp=tp, pp=pp, recompute=recompute, recompute_modules=modules, offload=offload),
                          8 // (tp * pp), 1)
    return predict(inventory, record, S, BATCH, hardware=Hardware(memory=1e12, **hardware), calibrate=False)


def test_offload_leaves_the_offloaded_terms_on_the_host_and_counts_their_traffic(inventory):
    base = _predict(inventory)
    offload = ("attn_norm", "mlp_norm", "mlp")
    moved = _predict(inventory, offload=offload)
    per_layer = offloaded_layer_bytes(inventory, S, 1, 8, recompute="selective", offload=offload)
    assert per_layer == sum(offloaded_layer_bytes(inventory, S, 1, 8, recompute="selective", offload=(m,))
                            for m in offload)
    assert layer_bytes(inventory, S, 1, 8, recompute="selective", offload=offload) + per_layer == layer_bytes(
        inventory, S, 1, 8, recompute="selective")
    layers, m = inventory.num_layers, base.layout.num_microbatches
    assert moved.host["moved_per_step"] == per_layer * layers * m
    assert moved.host["held"] == per_layer * layers  # pp 1: one micro-batch's layers in flight
    # (the peak may fall at another moment of the step with the offload: less by at least the layers before the last)
    assert base.bytes["activations"] - moved.bytes["activations"] >= per_layer * (layers - 1)
    _, exposed = host_traffic(per_layer, layers, m, layers, base.step_time["compute"], Hardware().host_bandwidth)
    assert moved.step_time["offload"] == exposed
    assert moved.step_time["total"] == pytest.approx(base.step_time["total"] + exposed)
    slow = _predict(inventory, offload=offload, host_bandwidth=1e9)  # a slow link shows
    assert slow.step_time["offload"] > moved.step_time["offload"]


def test_the_mlp_recomputed_keeps_its_input_and_costs_one_mlp_forward_per_layer(inventory):
    base, mlp = _predict(inventory), _predict(inventory, modules=("mlp",))
    assert mlp.bytes["activations"] < base.bytes["activations"]
    shape = TransformerShape(s=S, b=1, h=inventory.hidden_size, a=inventory.num_heads, L=inventory.num_layers,
                             v=inventory.vocab_size, ffn_hidden_size=inventory.ffn_hidden_size)
    assert mlp.flops["hardware"] - base.flops["hardware"] == inventory.num_layers * mlp_forward_flops(shape, BATCH)


@pytest.mark.parametrize("recompute, modules, offload, reason", [
    ("full", (), ("mlp",), "nothing to offload"),
    ("selective", (), ("core_attn",), "core_attn both recomputed (core_attn) and offloaded"),
    ("none", ("mlp",), ("mlp",), "mlp both recomputed (mlp) and offloaded"),
    ("none", ("moe_act",), (), "this model has no mixture of experts"),
    ("none", (), ("expert_fc1",), "this model has no mixture of experts"),
    ("full", ("layernorm",), (), "recomputing modules changes nothing"),
])
def test_what_cannot_go_together_is_refused_by_rule(inventory, recompute, modules, offload, reason):
    record = _predict(inventory, recompute, modules, offload)
    assert not record.feasible and reason in record.reason


def test_an_offload_beyond_the_host_memory_is_refused(inventory):
    record = _predict(inventory, "none", (), DENSE_OFFLOAD_MODULES, host_memory=1e9)
    assert not record.feasible and "GB of host memory per GPU" in record.reason


def test_the_planner_trades_offload_for_memory_only_when_asked_and_says_why():
    inventory = model_inventory("gpt-22b", S, "eager")
    options = dict(hardware=Hardware(), calibrate=False, context_parallel=(1,), micro_batches=(1,))
    plain = plan(inventory, 16, S, 16, **options)
    traded = plan(inventory, 16, S, 16, memory_choices=True, **options)
    assert not any(r.layout.offload or r.layout.recompute_modules for r in plain)
    chosen = [r for r in traded if r.feasible and (r.layout.offload or r.layout.recompute_modules)]
    assert chosen and all(r.why and "alone needs" in r.why for r in chosen)
    for r in chosen:  # each replaced a layout of the same sizes that did not fit
        untraded = r.layout.replace(recompute_modules=(), offload=())
        same = [p for p in plain if (p.layout, p.dp, p.micro_batch) == (untraded, r.dp, r.micro_batch)]
        assert same and not same[0].feasible and same[0].bytes["total"] > r.bytes["total"]
    # the feasible ones compete by step time, traded or not
    times = [r.step_time["total"] for r in traded if r.feasible]
    assert times == sorted(times)


def test_the_command_prints_what_it_traded(capsys):
    from lightning_seqpar.plan.__main__ import main

    main(["gpt-22b", "--gpus", "16", "--seq-len", str(S), "--global-batch", "16", "--analytic", "--cp", "1",
          "--memory-choices", "--top", "3", "--schedule", "1F1B", "--headroom", "0.78"])
    # the layouts this test was written for: tp 4 pp 4 v 2 selective needs 63.4 GB, over 0.78 × 80 GB
    out = capsys.readouterr().out
    assert "Traded for memory" in out and "selective|offload attn_norm,mlp_norm" in out, out


def test_a_mixture_trades_its_experts_modules_and_a_dense_mlp_s_are_refused_by_rule():
    from lightning_seqpar.plan.pricing.memory_choices import MIXTURE_TRADES
    from tests.plan.test_planner_experts import QWEN3_30B_A3B

    tiny = model_inventory(dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32))
    records = plan(tiny, 2, 1024, 8, hardware=Hardware(memory=7e7), calibrate=False, micro_batches=(8,),
                   memory_choices=True)
    tried = {(r.layout.recompute_modules, r.layout.offload) for r in records
             if r.layout.recompute_modules or r.layout.offload}
    assert tried == set(MIXTURE_TRADES)  # every trade is tried somewhere; none names the dense MLP
    for modules, offload in ((("mlp",), ()), ((), ("mlp",)), (("moe",), ("expert_fc1",)), (("moe_act",), ("moe_act",))):
        record = predict(tiny, LayoutRecord(Layout(recompute_modules=modules, offload=offload), 2, 1),
                         1024, 8, calibrate=False)
        assert not record.feasible and ("mixtures of experts" in record.reason or "both recomputed" in record.reason)
