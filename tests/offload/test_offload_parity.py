"""``ActivationOffload`` in the Trainer: bit-identical training to no offload (float64, loss and every gradient, three
AdamW steps) under tensor + sequence parallelism, the pipeline (1F1B, interleaved, GPipe), context parallelism and
recomputation, on the reference GPT, a post-norm encoder, Hugging Face Llama, Qwen3 and Qwen3-MoE; at tp 2 with SP the
bytes a layer leaves on the device and moves to the host are the model's, to the byte, for every module and pair."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lightning_seqpar import ActivationOffload, SelectiveRecompute
from lightning_seqpar.memory import TransformerShape, layer_activation_terms
from lightning_seqpar.memory.mixture import MixtureShape
from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES
from lightning_seqpar.offload.plan import plan_offload
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, SEQ
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed

STEPS = 3
ALL = list(DENSE_OFFLOAD_MODULES)
LABELS = ("labels", True)
CASES = {  # world size: (case, offloaded modules, recomputation callbacks' arguments or None)
    2: [
        (Case("gpt", 2), ALL, None),                                                 # tp 2 + SP
        (Case("gpt", 2, model=(("dropout", 0.1),)), ["core_attn", "mlp", "attn_norm"], None),  # masks come back
        (Case("encoder", 2, model=(("norm_first", False),)), ALL, None),             # post-norm
        (Case("hf", 2, model=(LABELS,)), ALL, None),                                 # Llama: rotary, gated MLP
        (Case("hf", 2, model=(LABELS, ("family", "qwen3"))), ALL, None),             # per-head q/k norms
        (Case("hf", 2, model=(LABELS, ("lora", "attention"))), ALL, None),           # LoRA: frozen bases stay
        (Case("gpt", 2), ["attn_norm", "qkv_linear", "attn_proj", "mlp"], dict(granularity="selective")),
        (Case("gpt", 2, model=(("n_layer", 4),)), ALL, dict(modules=["full"], method="block", num_layers=2)),
        (Case("gpt", 1, pp=2), ALL, None),                                           # two pipeline stages
        (Case("gpt", 1, model=(("n_layer", 4),), pp=2, strategy=(("virtual_stages", 2), ("num_microbatches", 4)),
              batch=4), ALL, None),                                          # interleaved 1F1B
        (Case("gpt", 1, pp=2, strategy=(("schedule", "gpipe"),)), ["attn_norm", "core_attn", "mlp"], None),
        (Case("gpt", 1, pp=2, strategy=(("schedule", "ZB-H1"),)), ALL, None),       # W reads what B brought back
        (Case("hf", 1, model=(LABELS,), cp=2), ALL, None),                           # context parallel (ring)
        # a mixture of experts at ep 2: the rows its experts receive, their activation's inputs
        (Case("hf", 2, model=(LABELS, ("family", "qwen3_moe"), ("aux", 0.5)), strategy=(("ep", 2),)),
         ["attn_norm", "core_attn", "expert_fc1", "moe_act"], None),
        (Case("hf", 2, model=(LABELS, ("family", "qwen3_moe")), strategy=(("ep", 2),)), ["expert_fc1", "qkv_linear"],
         dict(modules=["moe_act", "layernorm"])),
    ],
    4: [
        (Case("gpt", 2, pp=2), ALL, None),                                           # pp 2 × tp 2
    ],
}
MIXTURE = MixtureShape(4, 2, 32, ep=2, grouped=False)  # the GPT's 4 experts of 4h/k, float64 (the loop over experts)
MIXTURE_SHAPE = TransformerShape(s=SEQ, b=BATCH, h=16, a=4)
DENSE_ONLY = [m for m in DENSE_OFFLOAD_MODULES if m != "mlp"]
MIXTURE_BUDGET = (Case("gpt", 2, model=(("n_experts", 4),), strategy=(("ep", 2),)),
                  2 * sum(layer_activation_terms(MIXTURE_SHAPE, 2, True, bytes_per_element=8, offload=DENSE_ONLY,
                                                 experts=MIXTURE).values()) - 1)
BYTES = [(m,) for m in DENSE_OFFLOAD_MODULES] + list(itertools.combinations(DENSE_OFFLOAD_MODULES, 2))


def _world(rank: int, world: int) -> dict:
    from lightning_seqpar.memory import TransformerShape
    from lightning_seqpar.parallel import ParallelGroup
    from recipes.benchmarking.measure import measure_gpt_layer

    out: dict = {"parity": [], "bytes": []}
    for case, modules, recompute in CASES[world]:
        before = [SelectiveRecompute(**recompute)] if recompute else []
        offload = ActivationOffload(modules=modules)
        # the records alone (a model with transformers' output-capturing hooks does not pickle)
        out["parity"].append((dataclasses.replace(fit(case, world, steps=STEPS, callbacks=before)),
                              dataclasses.replace(fit(case, world, steps=STEPS, callbacks=[*before, offload])),
                              offload.pool.counts()))
    if world == 4:  # a budget the last stage (one micro-batch in flight) fits and the first (two) does not
        from lightning_seqpar.memory.activations import layer_activation_bytes

        per_layer = layer_activation_bytes(TransformerShape(s=SEQ, b=1, h=16, a=4), 2, True, bytes_per_element=8)
        case = Case("gpt", 2, pp=2)
        offload = ActivationOffload(memory_budget=1.5 * per_layer)
        out["budget"] = (dataclasses.replace(fit(case, world, steps=STEPS, callbacks=[offload])), offload.plan,
                         offload.pool.counts())
    if world == 2:  # a mixture of experts' budget: only a plan with the experts' modules fits
        case, budget = MIXTURE_BUDGET
        offload = ActivationOffload(memory_budget=budget)
        out["mixture budget"] = (dataclasses.replace(fit(case, world, steps=STEPS)),
                                 dataclasses.replace(fit(case, world, steps=STEPS, callbacks=[offload])), offload.plan,
                                 offload.pool.counts())
        group = ParallelGroup(torch.distributed.group.WORLD)
        for modules in BYTES:
            m = measure_gpt_layer(TransformerShape(s=64, b=2, h=64, a=4), group, True, "none", offload=modules,
                                  norm_statistics_bytes=2)
            out["bytes"].append((m.measured_bytes - m.model_bytes, m.offloaded_bytes, m.model_offloaded))
    return out


@pytest.fixture(scope="module")
def worlds():
    done: dict[int, list[dict]] = {}

    def of(world: int) -> list[dict]:
        if world not in done:
            done[world] = run_distributed(_world, world)
        return done[world]
    return of


@pytest.mark.parametrize("world, index", [(w, i) for w in CASES for i in range(len(CASES[w]))],
                         ids=[f"w{w}-{c.kind}-tp{c.tp}-pp{c.pp}-cp{c.cp}-{'+'.join(m) if m != ALL else 'all'}"
                              f"{'-recompute' if r else ''}" for w in CASES for c, m, r in CASES[w]])
def test_offload_trains_bit_identically_to_none(worlds, world, index):
    for rank, results in enumerate(worlds(world)):
        plain, offloaded, counts = results["parity"][index]
        assert offloaded.losses == plain.losses, rank
        for step, (got, want) in enumerate(zip(offloaded.grads, plain.grads)):
            assert got.keys() == want.keys()
            differ = [name for name in want if not torch.equal(got[name], want[name])]
            assert differ == [], f"rank {rank} step {step}: {differ}"
        # something moved on every rank, all of it came back, and the pool is empty after training
        assert counts["bytes_out"] > 0 and counts["bytes_in"] == counts["bytes_out"] and counts["held"] == 0, counts


@pytest.mark.parametrize("index", range(len(BYTES)), ids=["+".join(m) for m in BYTES])
def test_bytes_left_and_moved_equal_the_model_at_tp2_with_sequence_parallelism(worlds, index):
    for rank, results in enumerate(worlds(2)):
        device_error, moved, model_moved = results["bytes"][index]
        assert device_error == 0, rank
        assert moved == model_moved > 0, rank


def test_a_budget_offloads_on_the_stage_with_more_micro_batches_in_flight_and_the_same_on_every_rank_of_it(worlds):
    runs = worlds(4)
    plans = [results["budget"][1] for results in runs]
    assert plans[0] == plans[1] and plans[2] == plans[3]  # rank = tp_rank + 2·pp_rank: a stage decides once
    assert plans[0].in_flight == 2 and plans[2].in_flight == 1
    assert plans[0].modules and plans[2].modules == (), plans
    assert [results["budget"][2]["bytes_out"] > 0 for results in runs] == [True, True, False, False]
    for rank, results in enumerate(runs):
        recorded = results["budget"][0]  # against pp 2 × tp 2 without offload
        assert recorded.losses == results["parity"][0][0].losses, rank
        for got, want in zip(recorded.grads, results["parity"][0][0].grads):
            assert [n for n in want if not torch.equal(got[n], want[n])] == [], rank


def test_a_budget_for_a_mixture_of_experts_offloads_the_experts_modules_by_the_model_and_trains_identically(worlds):
    case, budget = MIXTURE_BUDGET
    want = plan_offload(MIXTURE_SHAPE, 2, True, budget, 2, bytes_per_element=8, experts=MIXTURE)
    assert {"expert_fc1", "moe_act"} & set(want.modules) and want.device_bytes <= budget
    for rank, results in enumerate(worlds(2)):
        plain, offloaded, plan, counts = results["mixture budget"]
        assert plan == want, rank  # balanced routing: a function of the configuration, the same on every rank
        assert counts["bytes_out"] > 0 and counts["bytes_in"] == counts["bytes_out"], rank
        assert offloaded.losses == plain.losses, rank
        for got, expected in zip(offloaded.grads, plain.grads):
            assert [n for n in expected if not torch.equal(got[n], expected[n])] == [], rank
