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


def _oss_glu(gate_up, alpha=1.702, limit=0.5):
    """gpt-oss's gating: gate and up interleaved, clamped, (up + 1) · gate · σ(α · gate)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _filled(experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return experts


@pytest.mark.parametrize("transposed, bias", [(False, False), (True, True)])
def test_the_grouped_gemm_computes_what_the_loop_computes_and_an_empty_expert_gets_zeros(transposed, bias):
    # widths of 16 float32 values: 64-byte strides, as grouped_mm takes them
    kw = dict(transposed=transposed, bias=bias, glu=_oss_glu if transposed else None)
    grouped, loop = (_filled(GroupedExperts(4, 16, 8, dtype=torch.float32, grouped_mm=g, **kw)) for g in (True, False))
    assert grouped._grouped(torch.zeros(3, 16)) and not loop._grouped(torch.zeros(3, 16))
    sizes = [3, 0, 5, 2]  # expert 1 receives nothing
    rows = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(2))
    outs = []
    for experts in (grouped, loop):
        x = rows.clone().requires_grad_()
        out = experts(x, sizes, torch.tensor(sizes))
        (out * upstream).sum().backward()
        outs.append((out.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    for name, grad in outs[0][2].items():
        torch.testing.assert_close(grad, outs[1][2][name], rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(grad[1]) == 0, name  # the empty expert: zeros, not None


def test_transposed_experts_with_biases_compute_gpt_oss_s_experts_token_by_token():
    experts = _filled(GroupedExperts(4, 6, 3, transposed=True, bias=True, glu=_oss_glu, dtype=torch.float64))
    assert experts.gate_up_proj.shape == (4, 6, 6) and experts.down_proj.shape == (4, 3, 6)
    sizes = [2, 1, 0, 3]
    rows = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = experts(rows, sizes)
    want, start = [], 0
    for e, n in enumerate(sizes):  # transformers' GptOssExperts: x @ W + b, per expert
        for x in rows[start:start + n]:
            hidden = _oss_glu(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
            want.append(hidden @ experts.down_proj[e] + experts.down_proj_bias[e])
        start += n
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-12, atol=1e-12)


def test_the_grouped_gemm_takes_an_expanded_gradient():
    experts = _filled(GroupedExperts(4, 16, 8, dtype=torch.float32))
    experts(torch.randn(6, 16, requires_grad=True), [2, 0, 3, 1]).sum().backward()  # the gradient: strides of 0
    assert experts.down_proj.grad is not None and torch.count_nonzero(experts.down_proj.grad[1]) == 0


def test_float64_and_unaligned_widths_take_the_loop():
    assert not GroupedExperts(4, 16, 8, dtype=torch.float64)._grouped(torch.zeros(3, 16, dtype=torch.float64))
    assert not GroupedExperts(4, 6, 3, dtype=torch.float32)._grouped(torch.zeros(3, 6))  # 24-byte rows
