"""The gradients a pipelined training step sets aside while its schedule runs (single process: no buckets)."""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_seqpar.optim.grad_sync import ScheduleGradients


def _params():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 5.0)
    return params


def test_a_window_s_first_batch_releases_the_last_step_s_gradients():
    params = _params()
    stale = [p.grad for p in params]
    gradients = ScheduleGradients(params, None, 1.0, accumulated=False)
    assert all(p.grad is None for p in params)
    assert all(s is not g for s in stale for g in gradients._earlier if g is not None)  # nothing held aside
    (params[0].sum() * 2).backward()
    fresh = gradients.fresh()
    assert torch.equal(fresh[params[0]], torch.full((3,), 2.0))
    assert params[0].grad is None and params[1].grad is None  # zero_grad would have dropped the stale ones


def test_a_later_batch_keeps_the_window_s_gradients_aside_and_hands_them_back():
    params = _params()
    gradients = ScheduleGradients(params, None, 0.5, accumulated=True)
    assert all(p.grad is None for p in params)
    (params[1].sum() * 3).backward()
    fresh = gradients.fresh()
    assert torch.equal(fresh[params[1]], torch.full((2,), 3.0))
    assert all(torch.equal(p.grad, torch.full_like(p, 5.0)) for p in params)
