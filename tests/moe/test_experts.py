"""One rank (ep 1): the dispatcher and the grouped experts compute the token-by-token reference; sizes that do not
split are refused naming the fix."""

import pytest
import torch

from lightning_seqpar.moe import GroupedExperts, TokenDispatcher
from lightning_seqpar.parallel import ParallelGroup
from tests.helpers.moe import E, EMPTY, F_, H, data, reference, weights


def test_one_rank_computes_the_reference_and_an_unrouted_expert_gets_zeros():
    experts = GroupedExperts(E, H, F_).double()
    with torch.no_grad():
        experts.gate_up_proj.copy_(weights()[0])
        experts.down_proj.copy_(weights()[1])
    x, ids, scores, upstream = data(0)
    x.requires_grad_()
    scores.requires_grad_()
    dispatcher = TokenDispatcher(ParallelGroup(), E)
    rows, routing = dispatcher.dispatch(x, ids)
    assert routing.tokens_per_expert == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    out = dispatcher.combine(experts(rows, routing.tokens_per_expert), routing, scores)
    (out * upstream).sum().backward()
    outs, grads, gate_up, down = reference([0])
    torch.testing.assert_close(out.detach(), outs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, grads[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scores.grad, grads[0][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(experts.gate_up_proj.grad, gate_up, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(experts.down_proj.grad, down, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(experts.down_proj.grad[EMPTY]) == 0


def test_experts_that_do_not_split_over_ep_are_refused():
    with pytest.raises(ValueError, match="6 experts do not split over ep=4 ranks"):
        GroupedExperts(6, H, F_, expert_parallel=4)
    with pytest.raises(ValueError, match="6 experts do not split over ep=4 ranks"):
        TokenDispatcher(ParallelGroup.virtual(4), 6)


def test_all_to_all_v_refuses_splits_that_do_not_add_up():
    with pytest.raises(ValueError, match=r"send \[2, 2\] for 3 rows"):
        ParallelGroup.virtual(2).all_to_all_v(torch.zeros(3, 2), [2, 2], [1, 1])
