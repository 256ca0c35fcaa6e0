"""Dispatch with an expert capacity (``DispatchConfig(capacity_factor=...)``): each expert keeps at most
``C = ⌈factor·n·k/E⌉`` of a rank's pairs, by router score or by position, ties to the earlier pair; the outputs and
the gradients of tokens, scores and every expert equal a token-by-token reference applying that rule to each rank's
tokens (float64), on one process (over 2 and 4 expert-parallel ranks: test_capacity_over_ranks.py); no host read; a
capacity that drops nothing computes the dropless dispatch; the drops are the same on
every run."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_seqpar.moe import CapacityDispatcher, DispatchConfig, GroupedExperts, TokenDispatcher, expert_capacity
from lightning_seqpar.parallel import ParallelGroup
from tests.helpers.moe import E, F_, H, K, N, data, weights
from tests.helpers.op_counter import HOST_READ, OpCounter


def capacity_reference(ranks, capacity, policy):
    """One process, every expert, token by token, each rank's pairs capped per expert as the rule says."""
    gate_up, down = (w.clone().requires_grad_() for w in weights())
    inputs = [(x.clone().requires_grad_(), ids, s.clone().requires_grad_(), u) for x, ids, s, u in map(data, ranks)]
    loss, outs, dropped = 0.0, [], []
    for x, ids, scores, upstream in inputs:
        kept = set()
        for e in range(E):
            pairs = [(i, j) for i in range(N) for j in range(K) if int(ids[i, j]) == e]  # token order
            if policy == "probs":
                pairs.sort(key=lambda p: -float(scores[p]))  # stable: a tie keeps the earlier pair first
            kept.update(pairs[:capacity])
        rows = []
        for i in range(N):
            row = torch.zeros(H, dtype=torch.float64)
            for j in range(K):
                if (i, j) in kept:
                    e = int(ids[i, j])
                    gate, up = (gate_up[e] @ x[i]).chunk(2)
                    row = row + scores[i, j] * (down[e] @ (F.silu(gate) * up))
            rows.append(row)
        out = torch.stack(rows)
        outs.append(out.detach())
        dropped.append(N * K - len(kept))
        loss = loss + (out * upstream).sum()
    loss.backward()
    return outs, [(x.grad, s.grad) for x, _, s, _ in inputs], gate_up.grad, down.grad, dropped


def _run(group, rank, ep, config, dispatcher_class=CapacityDispatcher):
    experts = GroupedExperts(E, H, F_, expert_parallel=ep).double()
    local = E // ep
    gate_up, down = weights()
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up[group.rank * local:(group.rank + 1) * local])
        experts.down_proj.copy_(down[group.rank * local:(group.rank + 1) * local])
    x, ids, scores, upstream = data(rank)
    x.requires_grad_()
    scores.requires_grad_()
    dispatcher = dispatcher_class(group, E, config) if dispatcher_class is CapacityDispatcher else \
        dispatcher_class(group, E)
    lists, tolist = [], torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: lists.append(self.numel()) or tolist(self)  # .tolist() bypasses dispatch
    try:
        with OpCounter({HOST_READ: "read"}) as reads:
            rows, routing = dispatcher.dispatch(x, ids, scores)
            out = dispatcher.combine(experts(rows, routing.tokens_per_expert, routing.expert_counts), routing, scores)
            (out * upstream).sum().backward()
    finally:
        torch.Tensor.tolist = tolist
    return dict(out=out.detach(), x=x.grad, scores=scores.grad, gate_up=experts.gate_up_proj.grad,
                down=experts.down_proj.grad, host_reads=(reads.counts["read"], lists), ep_rank=group.rank,
                slot=getattr(routing, "slot", None))


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
        SeqParallelStrategy(ep=2, moe={"factor": 1.0})
    assert SeqParallelStrategy(ep=2, moe={"capacity_factor": 1.5}).parallel.moe == DispatchConfig(1.5)
