"""``SelectiveRecompute(granularity="auto", memory_budget=...)`` picks the cheapest plan that fits."""

import pytest
import torch
import torch.nn as nn

from lightning_seqpar import RewriteContext, SelectiveRecompute, rewrite
from recipes.benchmarking.measure import remainder_kind
from lightning_seqpar.memory import TransformerShape, layer_activation_bytes
from lightning_seqpar.memory.tracker import LiveActivationTracker
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.recompute.planner import plan_recompute
from lightning_seqpar.transformer.core_attention import CoreAttention

SHAPE = TransformerShape(s=64, b=2, h=32, a=4, L=4)


def _per_layer(recompute, t=2, sp=True):
    return layer_activation_bytes(SHAPE, t, sp, recompute)


@pytest.mark.parametrize("t,sp", [(1, False), (2, True), (4, False)])
def test_plan_at_the_boundaries(t, sp):
    L = SHAPE.L
    none, sel, full = (layer_activation_bytes(SHAPE, t, sp, r) for r in ("none", "selective", "full"))
    plan = lambda budget: plan_recompute(SHAPE, t, sp, budget)  # noqa: E731
    assert plan(L * none).granularity == "none"
    assert (plan(L * none - 1).granularity, plan(L * none - 1).full_layers) == ("selective", 0)
    assert plan(L * sel) == plan(L * none - 1)
    for k in range(1, L + 1):
        fits = k * full + (L - k) * sel
        chosen = plan(fits)
        assert chosen.full_layers == k and chosen.activation_bytes == fits
        assert chosen.granularity == ("full" if k == L else "selective")
        if k < L:
            assert plan(fits - 1).full_layers == k + 1
    with pytest.raises(ValueError, match="No recomputation plan fits memory_budget=.*full recomputation of all 4"):
        plan(L * full - 1)


def test_auto_needs_a_budget():
    with pytest.raises(ValueError, match="memory_budget > 0"):
        SelectiveRecompute(granularity="auto")


def _rewritten_gpt():
    torch.manual_seed(0)
    root = nn.Module()
    root.gpt = GPT(GPTConfig(vocab_size=64, block_size=SHAPE.s, n_layer=SHAPE.L, n_head=SHAPE.a, n_embd=SHAPE.h,
                             dropout=0.1))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0), True))
    return root.gpt.to(torch.bfloat16).train()


def _live_layer_bytes(model):
    idx = torch.randint(0, 64, (SHAPE.b, SHAPE.s))
    model(idx, idx).backward()  # one-time buffers
    with LiveActivationTracker(model) as tracker:
        loss = model(idx, idx)
    # Every layer's own storages; its output is the next layer's (or the final norm's) saved input.
    records = tracker.live("transformer.h")
    del loss
    return sum(r.nbytes for r in records if remainder_kind(r) == "activation")


@pytest.mark.parametrize("k", [0, 1, 3])
def test_auto_applies_its_plan_and_the_model_keeps_what_it_said(k):
    model = _rewritten_gpt()
    L = SHAPE.L
    none, sel, full = (layer_activation_bytes(SHAPE, 1, False, r) for r in ("none", "selective", "full"))
    budget = L * none - 1 if k == 0 else k * full + (L - k) * sel
    callback = SelectiveRecompute(granularity="auto", memory_budget=budget)
    plan = callback.choose(model, SHAPE.s, SHAPE.b)
    assert plan.full_layers == k
    assert model.recompute_chunks == [(i, i + 1) for i in range(k)]
    flags = [m.recompute for m in model.modules() if isinstance(m, CoreAttention)]
    assert flags == [False] * k + [True] * (L - k)
    measured = _live_layer_bytes(model)
    # Exactly the plan's bytes, once LayerNorm statistics and RNG snapshots (not in Table 2) are set aside.
    assert measured == plan.activation_bytes
