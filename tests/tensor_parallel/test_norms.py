"""A norm over features split across tensor-parallel ranks (OLMo 2's q/k norms) equals the single-device norm, its
output and every gradient, on emulated ranks."""

import copy

import pytest
import torch
import torch.nn as nn

from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.tensor_parallel.norms import TensorParallelRMSNorm


class RMSNorm(nn.Module):  # T5 / OLMo 2's form, as transformers writes it
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dtype=torch.float64))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x).to(dtype)


@pytest.mark.parametrize("t", [2, 4])
def test_the_split_norm_is_the_single_device_norm_with_its_gradients(t):
    torch.manual_seed(0)
    norm = RMSNorm(16)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 5, 16, dtype=torch.float64)
    (norm(x) * weights).sum().backward()

    def one_rank(group):
        local_x = x.detach().chunk(t, -1)[group.rank].clone().requires_grad_()
        split = TensorParallelRMSNorm(copy.deepcopy(norm), group)
        out = split(local_x)
        (out * weights.chunk(t, -1)[group.rank]).sum().backward()
        return out.detach(), local_x.grad, split.weight.grad

    ranks = run_emulated(t, one_rank)
    torch.testing.assert_close(torch.cat([r[0] for r in ranks], -1), norm(x).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in ranks], -1), x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[2] for r in ranks], -1), norm.weight.grad, rtol=1e-6, atol=1e-6)
