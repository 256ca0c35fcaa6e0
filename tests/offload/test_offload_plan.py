"""The offload plan for a byte budget: a pure function of the configuration that fits the budget with the fewest bytes
moved, offloads less on pipeline ranks with fewer micro-batches in flight, and refuses a budget nothing fits."""

from __future__ import annotations

import itertools

import pytest

from lightning_seqpar.memory import TransformerShape
from lightning_seqpar.memory.activations import layer_activation_bytes, offloaded_activation_terms
from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES
from lightning_seqpar.offload.plan import plan_offload
from lightning_seqpar.pipeline_parallel.schedules import simulate

SHAPE = TransformerShape(s=2048, b=1, h=1024, a=16)
T, SP, LAYERS = 2, True, 8
NONE = LAYERS * layer_activation_bytes(SHAPE, T, SP)


def _moved(modules) -> float:
    return LAYERS * sum(offloaded_activation_terms(SHAPE, T, SP, offload=modules).values())


@pytest.mark.parametrize("fraction", [1.0, 0.9, 0.6, 0.4, 0.2, 0.1])
def test_the_plan_fits_and_no_other_choice_that_fits_moves_fewer_bytes(fraction):
    budget = fraction * NONE
    plan = plan_offload(SHAPE, T, SP, budget, LAYERS)
    assert plan.device_bytes <= budget
    assert plan.device_bytes + plan.host_bytes == pytest.approx(NONE)
    assert plan.moved_per_micro_batch == _moved(plan.modules)
    for size in range(len(DENSE_OFFLOAD_MODULES) + 1):
        for other in itertools.combinations(DENSE_OFFLOAD_MODULES, size):
            if NONE - _moved(other) <= budget:
                assert _moved(other) >= plan.moved_per_micro_batch, other
    assert plan == plan_offload(SHAPE, T, SP, budget, LAYERS)  # the same every time it is asked
    if fraction == 1.0:
        assert plan.modules == ()


def test_pipeline_ranks_with_fewer_micro_batches_in_flight_offload_less():
    p, m = 4, 8
    in_flight = simulate("1F1B", m, p)
    assert in_flight == [p - r for r in range(p)]  # the 1F1B formula: rank r holds p − r micro-batches
    budget = 2.5 * NONE
    plans = [plan_offload(SHAPE, T, SP, budget, LAYERS, in_flight=n) for n in in_flight]
    moved = [plan.moved_per_micro_batch for plan in plans]
    assert moved == sorted(moved, reverse=True) and moved[0] > 0 and moved[-1] == 0, [p.modules for p in plans]
    assert all(plan.device_bytes <= budget for plan in plans)


def test_recomputed_modules_are_never_chosen_and_full_recomputation_needs_nothing():
    plan = plan_offload(SHAPE, T, SP, 0.3 * NONE, LAYERS, recompute="selective", modules=["mlp"])
    assert "core_attn" not in plan.modules and "mlp" not in plan.modules
    full = plan_offload(SHAPE, T, SP, NONE, LAYERS, recompute="full")
    assert full.modules == () and full.host_bytes == 0


def test_a_budget_nothing_fits_is_refused_with_the_least_and_the_fixes():
    with pytest.raises(ValueError, match=r"No activation offload fits budget=1,000 bytes.*still leaves .* bytes.*"
                                         r"SelectiveRecompute\('full'\)"):
        plan_offload(SHAPE, T, SP, 1000, LAYERS)
    with pytest.raises(ValueError, match="budget must be > 0"):
        plan_offload(SHAPE, T, SP, 0, LAYERS)
    from lightning_seqpar import ActivationOffload

    with pytest.raises(ValueError, match="one of them"):
        ActivationOffload(modules=["mlp"], memory_budget=1e9)
    with pytest.raises(ValueError, match="one of them"):
        ActivationOffload()


def test_a_mixture_s_plan_weighs_the_experts_modules_and_prices_dense_and_mixture_layers_apart():
    from lightning_seqpar.memory.activations import layer_activation_terms
    from lightning_seqpar.memory.mixture import MixtureShape

    experts = MixtureShape(64, 8, 512, ep=8)
    every = layer_activation_terms(SHAPE, T, SP, experts=experts)
    plans = [plan_offload(SHAPE, T, SP, fraction * LAYERS * sum(every.values()), LAYERS, experts=experts)
             for fraction in (0.9, 0.6, 0.4)]
    assert any({"expert_fc1", "moe_act"} & set(p.modules) for p in plans) and all("mlp" not in p.modules for p in plans)
    for plan in plans:  # what the plan leaves is the model's, layer by layer
        assert plan.device_bytes == LAYERS * sum(layer_activation_terms(SHAPE, T, SP, offload=plan.modules,
                                                                        experts=experts).values())
    # two of eight layers dense (DeepSeek's first layers): their MLP is priced dense, the experts' modules skip them
    mixed = plan_offload(SHAPE, T, SP, 1e12, LAYERS, experts=experts, mixture_layers=6)
    assert mixed.modules == () and mixed.device_bytes == 2 * layer_activation_bytes(SHAPE, T, SP) + 6 * sum(
        every.values())
    # the mixture recomputed whole keeps nothing the experts' modules could move
    recomputed = plan_offload(SHAPE, T, SP, 0.5 * LAYERS * sum(every.values()), LAYERS, modules=["moe"],
                              experts=experts)
    assert not {"expert_fc1", "moe_act"} & set(recomputed.modules)
    with pytest.raises(ValueError, match="mixture_layers within"):
        plan_offload(SHAPE, T, SP, 1e12, LAYERS, experts=experts, mixture_layers=9)
