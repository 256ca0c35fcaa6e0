"""Every term the planner prices a layout's activations with, against the same term measured on the model at its full
size, over the grid of precision × recomputation × LoRA × tp of ``recipes/plan_check.py``'s model (Llama h 256,
f 1024, 8 heads, v 512, s 256, micro-batch 4): a layer's bytes, the first layer's (less where the embedding is frozen),
and what the forward keeps outside the layers — never negative, each within 1 %. LoRA's outside term was once fitted
as the whole forward less three middle layers, so the first layer's saving was taken off twice: −29 MB under
bf16-mixed, a 54.9 MB peak priced at 27.0 MB."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar import Layout
from lightning_seqpar.plan.pricing.layout_record import LayoutRecord
from lightning_seqpar.plan.measuring.fits import ProbedMeasurements
from lightning_seqpar.plan.pricing.kept import (activation_element_bytes, first_layer_saving, layer_activation_bytes,
                                                outside_bytes)
from lightning_seqpar.plan.measuring.probe import measure
from recipes.benchmarking.plan_check import _built

pytestmark = pytest.mark.slow  # the planner's probes: outside the fast lane

MODEL = dict(vocab_size=512, hidden=256, ffn=1024, heads=8, layers=4, s=256)
S, B = 256, 4
FULL_SIZE = dict(head_dim=32, hidden_size=256, intermediate_size=1024, vocab_size=512)


@pytest.fixture(scope="module")
def shared():
    from lightning_seqpar.plan import inventory_of_hf_model

    inventories = {}
    for lora in (0, 4):
        with torch.device("meta"):
            inventories[lora] = inventory_of_hf_model(_built(dict(MODEL, lora_r=lora)))
    # the inventories, the probes' fits, the full-size measurements
    return inventories, ProbedMeasurements({}), {}


GRID = [(precision, recompute, 4, tp) for precision in ("bf16-mixed", "bf16-true", "32-true")
        for tp in (1, 2) for recompute in ("none", "selective", "full")]
GRID += [("bf16-mixed", recompute, 0, 1) for recompute in ("none", "selective", "full")]  # dense, for contrast


@pytest.mark.parametrize("precision, recompute, lora, tp", GRID)
def test_each_priced_term_is_the_measured_one_at_full_size(shared, precision, recompute, lora, tp):
    inventories, fits, measured = shared
    inventory = inventories[lora]

    def at_full_size(kind: str):
        key = (precision, kind, lora, tp)
        if key not in measured:
            measured[key] = measure(inventory.config, tp, True, kind, precision, S, B, FULL_SIZE,
                                    training=inventory.training)
        return measured[key]

    record = LayoutRecord(Layout(tp=tp, num_microbatches=1, recompute=recompute), 2 // tp, B)
    layer = layer_activation_bytes(record, inventory, S, precision, False, fits)
    saving = first_layer_saving(record, inventory, S, precision, fits)
    outside, prologue = outside_bytes(record, inventory, S, precision, activation_element_bytes(precision), fits)
    assert min(layer, layer - saving, outside, prologue) >= 0  # (the first layer may keep more than the others)
    kept = at_full_size(recompute)
    assert layer == pytest.approx(kept.layer, rel=0.01)
    # Outside the layers, the prologue's mask is priced as kept where a checkpointed attention keeps it (selective);
    # under full recomputation at pp 1 with the backward's temporaries instead (transients.py): the same forward
    # without recomputation is the reference there.
    reference = at_full_size("selective" if recompute == "selective" else "none")
    if lora:  # the first layer priced apart: its input, the frozen embedding's output, needs no gradient
        assert layer - saving == pytest.approx(kept.first, rel=0.01)
        if recompute == "none":
            assert saving > 0.01 * layer
        assert outside == pytest.approx(reference.everything - 2 * reference.layer - reference.first, rel=0.01)
    else:  # priced as a middle layer, the layers' copy of its input counted outside them (the stage input)
        assert saving == 0
        assert outside == pytest.approx(reference.everything - 3 * reference.layer, rel=0.01)
