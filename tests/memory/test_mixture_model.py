"""The memory model's mixture of experts (:mod:`lightning_seqpar.memory.mixture`) on its own: balanced routing's rows,
what offloading the experts moves, and the choices a mixture refuses; ``test_mixture_bytes`` measures the same terms on
the real layers."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_seqpar.memory import TransformerShape, layer_activation_terms
from lightning_seqpar.memory.activations import offloaded_activation_terms
from lightning_seqpar.memory.mixture import MixtureShape

CHOICES = [((), ()), (("moe_act",), ()), (("moe",), ()), (("layernorm",), ()), (("moe", "layernorm"), ()),
           (("moe_act", "layernorm"), ()), (("core_attn", "moe_act"), ()), ((), ("expert_fc1",)), ((), ("moe_act",)),
           ((), ("expert_fc1", "moe_act")), ((), ("mlp_norm", "expert_fc1")), ((), ("attn_norm", "moe_act")),
           (("moe_act",), ("expert_fc1",)), (("core_attn",), ("moe_act",)), (("moe",), ("mlp_norm",))]
"""(recomputed by module, offloaded) pairs the measured layers run"""
GRIDS = {"ep2": MixtureShape(4, 2, 48, ep=2), "expert_tp2": MixtureShape(4, 2, 48, expert_tp=2),
         "ep2-capacity": MixtureShape(4, 2, 48, ep=2, capacity_factor=1.5),
         "expert_tp2-capacity": MixtureShape(4, 2, 48, expert_tp=2, capacity_factor=0.6)}
SHAPE = TransformerShape(s=32, b=2, h=64, a=4)


def test_balanced_routing_sends_and_receives_n_k_etp_rows_and_the_terms_scale_with_them():
    n = SHAPE.s * SHAPE.b / 2  # tp 2 with SP
    for mixture in (m for m in GRIDS.values() if m.capacity_factor is None):
        terms = layer_activation_terms(SHAPE, 2, True, experts=mixture)
        pairs = n * mixture.top_k * mixture.expert_tp
        assert terms["expert rows"] == 2 * pairs * SHAPE.h == terms["pair outputs"]
        assert terms["expert gate and up"] == 2 * terms["expert fc2 input"] == 2 * 2 * pairs * 48 / mixture.expert_tp
        assert "GeLU input" not in terms and "fc1 input (LN2 output)" not in terms
        doubled = layer_activation_terms(SHAPE, 2, True, experts=MixtureShape(4, 2, 48, mixture.ep, mixture.expert_tp,
                                                                               rows=2 * pairs))
        assert doubled["expert rows"] == 2 * terms["expert rows"] and doubled["pair outputs"] == terms["pair outputs"]


def test_a_capacity_fixes_the_rows_whatever_the_routing():
    n = SHAPE.s * SHAPE.b / 2
    for name, capacity in (("ep2-capacity", 24), ("expert_tp2-capacity", 10)):  # ⌈1.5·32·2/4⌉, ⌈0.6·32·2/4⌉
        mixture = GRIDS[name]
        rows = 4 * mixture.expert_tp * capacity
        assert mixture.received(n) == rows and dataclasses.replace(mixture, rows=1).received(n) == 1
        terms = layer_activation_terms(SHAPE, 2, True, experts=mixture)
        assert terms["expert rows"] == 2 * rows * SHAPE.h and "received order (int64)" not in terms
        assert terms["pair inputs"] == terms["pair outputs"] == 2 * n * 2 * mixture.expert_tp * SHAPE.h


def test_offloading_the_experts_moves_their_terms_and_copies_the_offsets_the_down_projection_also_keeps():
    mixture = GRIDS["ep2"]
    kept = layer_activation_terms(SHAPE, 2, True, offload=("expert_fc1",), experts=mixture)
    moved = offloaded_activation_terms(SHAPE, 2, True, offload=("expert_fc1",), experts=mixture)
    assert set(moved) == {"expert rows", "expert offsets (int32)"} and "expert offsets (int32)" in kept
    assert moved["expert offsets (int32)"] == 4 * 4 / 2
    assert offloaded_activation_terms(SHAPE, 2, True, recompute="full", offload=("expert_fc1",), experts=mixture) == {}


@pytest.mark.parametrize("modules, offload, match", [
    (("moe",), ("expert_fc1",), r"expert_fc1 both recomputed \(moe\) and offloaded: .* the mixture's input"),
    (("moe_act",), ("moe_act",), r"moe_act both recomputed \(moe_act\) and offloaded: .* gate/up output"),
    ((), ("mlp",), r"not offloaded modules of this layer"),
    (("mlp",), (), r"'moe_act', 'moe', 'full'\] \(a mixture of experts\)"),
])
def test_a_choice_a_mixture_cannot_take_is_refused_by_name(modules, offload, match):
    with pytest.raises(ValueError, match=match):
        layer_activation_terms(SHAPE, 2, True, modules=modules, offload=offload, experts=GRIDS["ep2"])
