"""The experts' B/W split (:mod:`lightning_seqpar.moe.expert_product`): B then W give the unsplit backward's gradients
(bit for bit on the loop, float64; the grouped GEMM's float32 within rounding), an expert given no rows gets zeros in
W, W's FLOPs are the weight GEMMs' only and B's the input GEMMs', the parameters' accumulation hooks fire at W, and
``split_weight_gradients`` names the experts' weights (not their biases) as W's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_seqpar.moe.experts import GroupedExperts
from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

E, H, FFN = 4, 16, 8
SIZES = [3, 0, 5, 2]  # expert 1 gets no row


def _experts(dtype: torch.dtype, transposed: bool, bias: bool) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, FFN, dtype=dtype, transposed=transposed, bias=bias)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def _step(experts: GroupedExperts, store, rows: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """Forward and backward of ``(out · w).sum()``; with ``store``: the backward deferring, then W. Returns the rows'
    gradient, each parameter's, and the W halves run."""
    rows = rows.clone().requires_grad_()
    out = experts(rows, SIZES)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    ran = 0
    if store is None:
        (out * weights).sum().backward()
    else:
        with store.deferring("mb"):
            (out * weights).sum().backward()
        assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None  # W has not run
        ran = store.run("mb")
    return rows.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}, ran


@pytest.mark.parametrize("transposed,bias", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_b_then_w_equals_the_unsplit_backward(dtype, transposed, bias):
    plain = _experts(dtype, transposed, bias)
    split = copy.deepcopy(plain)
    store = WeightGradientStore()
    assert split_weight_gradients(split, store) == 1
    assert store.deferred == {id(split.gate_up_proj), id(split.down_proj)}  # the biases' gradients stay in B
    grouped = dtype == torch.float32 and hasattr(F, "grouped_mm")
    assert split._grouped(torch.zeros(1, H, dtype=dtype)) == grouped
    rows = torch.randn(sum(SIZES), H, dtype=dtype)
    want_rows, want, _ = _step(plain, None, rows)
    got_rows, got, ran = _step(split, store, rows)
    assert ran == 2 and store.pending == 0
    assert torch.count_nonzero(got["down_proj"][1]) == 0 and torch.count_nonzero(got["gate_up_proj"][1]) == 0
    if dtype == torch.float64:  # the loop: the same GEMMs as autograd's
        assert torch.equal(got_rows, want_rows)
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    else:  # the grouped GEMM: torch's backward sums in its own order
        torch.testing.assert_close(got_rows, want_rows, rtol=1e-5, atol=1e-6)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_w_computes_only_the_weight_gemms_and_hooks_fire_at_w():
    experts = _experts(torch.float64, False, False)
    store = WeightGradientStore()
    split_weight_gradients(experts, store)
    fired = []
    for name, p in experts.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.append((n, p.grad is not None)))
    rows = torch.randn(sum(SIZES), H, dtype=torch.float64, requires_grad=True)
    out = experts(rows, SIZES)
    with FlopCounterMode(display=False) as b_flops, store.deferring("mb"):
        out.sum().backward()
    assert not [f for f in fired if f[1]]  # torch calls the hooks in B with no gradient: nothing to take yet
    fired.clear()
    with FlopCounterMode(display=False) as w_flops:
        store.run("mb")
    assert sorted(n for n, has in fired if has) == ["down_proj", "gate_up_proj"]
    rows_total = sum(SIZES)
    weight_gemms = 2 * rows_total * (2 * FFN) * H + 2 * rows_total * H * FFN  # dW of gate/up and of down
    assert w_flops.get_total_flops() == weight_gemms
    assert b_flops.get_total_flops() == weight_gemms  # the input gradients: the same shapes transposed
