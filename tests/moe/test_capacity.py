"""Dispatch with an expert capacity (``DispatchConfig(capacity_factor=...)``): each expert keeps at most
``C = ⌈factor·n·k/E⌉`` of a rank's pairs, by router score or by position, ties to the earlier pair; the outputs and
the gradients of tokens, scores and every expert equal a token-by-token reference applying that rule to each rank's
tokens (float64), on one process (over 2 and 4 expert-parallel ranks: test_capacity_over_ranks.py); no host read; a
capacity that drops nothing computes the dropless dispatch; the drops are the same on
every run."""

import math

import pytest
import torch

from lightning_seqpar.moe import CapacityDispatcher, DispatchConfig, TokenDispatcher, expert_capacity
from lightning_seqpar.parallel import ParallelGroup
from tests.helpers.moe import E, K, N, data, local_experts, one_layer_call, reference


def capacity_rule(capacity, policy):
    """The pairs a rank's experts keep: each expert's first ``capacity`` in token order, or by score (a stable sort: a
    tie keeps the earlier pair first)."""
    def keep(ids, scores):
        kept = set()
        for e in range(E):
            pairs = [(i, j) for i in range(N) for j in range(K) if int(ids[i, j]) == e]  # token order
            if policy == "probs":
                pairs.sort(key=lambda p: -float(scores[p]))
            kept.update(pairs[:capacity])
        return kept
    return keep


def capacity_reference(ranks, capacity, policy):
    """One process, every expert, token by token, each rank's pairs capped per expert as the rule says; and the pairs
    each rank drops."""
    keep = capacity_rule(capacity, policy)
    dropped = [N * K - len(keep(ids, scores)) for _, ids, scores, _ in map(data, ranks)]
    return (*reference(ranks, keep), dropped)


def _run(group, rank, ep, config, dispatcher_class=CapacityDispatcher):
    dispatcher = dispatcher_class(group, E, config) if dispatcher_class is CapacityDispatcher else \
        dispatcher_class(group, E)
    result = one_layer_call(dispatcher, local_experts(ep, group.rank), rank)
    return dict(result, ep_rank=group.rank, slot=getattr(result.pop("routing"), "slot", None))


def _assert_equal(got, want_out, want_grads, gate_up, down, mine):
    torch.testing.assert_close(got["out"], want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["x"], want_grads[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["scores"], want_grads[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["gate_up"], gate_up[mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["down"], down[mine], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("factor, policy", [(0.5, "probs"), (0.5, "position"), (1.0, "probs")])
def test_one_rank_keeps_each_expert_s_first_pairs_by_the_policy(factor, policy):
    capacity = expert_capacity(N, K, E, factor)
    assert capacity == math.ceil(factor * N * K / E)
    got = _run(ParallelGroup(), 0, 1, DispatchConfig(factor, policy))
    outs, grads, gate_up, down, dropped = capacity_reference([0], capacity, policy)
    assert dropped[0] > 0  # the skewed routing overflows the capacity: the rule is exercised
    _assert_equal(got, outs[0], grads[0], gate_up, down, slice(0, E))
    assert got["host_reads"] == (0, [])
    again = _run(ParallelGroup(), 0, 1, DispatchConfig(factor, policy))
    assert torch.equal(again["slot"], got["slot"]) and torch.equal(again["out"], got["out"])  # the same drops


def test_a_capacity_that_drops_nothing_computes_the_dropless_dispatch():
    roomy = _run(ParallelGroup(), 0, 1, DispatchConfig(float(E)))  # C = n·k: every pair fits
    dropless = _run(ParallelGroup(), 0, 1, None, TokenDispatcher)
    for key in ("out", "x", "scores", "gate_up", "down"):
        torch.testing.assert_close(roomy[key], dropless[key], rtol=1e-12, atol=1e-12)


def test_bad_dispatch_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"capacity_factor=0: a positive number"):
        DispatchConfig(0)
    with pytest.raises(ValueError, match=r"drop_policy='random': one of probs, position"):
        DispatchConfig(1.0, "random")
    from lightning_seqpar import SeqParallelStrategy

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['factor'\]; the keys are capacity_factor and drop_policy"):
        SeqParallelStrategy(ep=2, layout={"moe": {"factor": 1.0}})
    assert SeqParallelStrategy(ep=2, layout={"moe": {"capacity_factor": 1.5}}).layout.moe == DispatchConfig(1.5)
