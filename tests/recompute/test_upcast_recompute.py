"""Operations CUDA autocast runs in float32 keep their 16-bit input, with autocast's numbers.

Measured under CUDA autocast's rule for norms and softmax applied to CPU autocast (``lightning_seqpar/memory/cuda_autocast.py``).
"""

import copy
import math
import pickle

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar.transformer.core_attention import CoreAttention
from lightning_seqpar.transformer.residual import cast_residual_stream, keep_16_bit_norm_inputs
from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules


class UpcastingRMSNorm(nn.Module):
    """Hugging Face's Llama RMSNorm, in its own words: float32 inside, the input's dtype out."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.1 * torch.randn(h))

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * hidden_states.to(dtype)


def _run(module, x):
    """Output, input gradient, parameter gradients and the float32 tensors of ``x``'s size kept for backward."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    kept = []

    def pack(t):
        if t.dtype == torch.float32 and t.numel() >= x.numel():
            kept.append(tuple(t.shape))
        return t

    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y, x.grad, [p.grad.clone() for p in module.parameters()], kept


def _check_same_numbers_and_16_bit_kept(make, x):
    torch.manual_seed(0)
    plain = make()
    kept_16 = copy.deepcopy(plain)
    keep_16_bit_norm_inputs(kept_16)
    y0, gx0, gp0, kept0 = _run(plain, x)
    y1, gx1, gp1, kept1 = _run(kept_16, x)
    assert kept0, "the plain norm keeps a float32 copy under CUDA autocast: nothing to compare"
    assert kept1 == []
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1))


def test_a_layer_norm_keeps_its_16_bit_input_with_autocasts_numbers():
    x = torch.randn(6, 2, 16).to(torch.bfloat16)
    _check_same_numbers_and_16_bit_kept(lambda: nn.LayerNorm(16), x)


def test_an_upcasting_rms_norm_keeps_its_16_bit_input_with_the_same_numbers():
    x = torch.randn(6, 2, 16).to(torch.bfloat16)
    _check_same_numbers_and_16_bit_kept(lambda: UpcastingRMSNorm(16), x)


def test_core_attention_keeps_16_bit_scores_with_autocasts_softmax():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    kept = []

    def pack(t):
        if t.dtype == torch.float32 and t.shape[-2:] == (8, 8):
            kept.append(tuple(t.shape))
        return t

    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = CoreAttention(causal=True)(q, k, v)
        out.float().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        # What autocast computes, written out: the softmax in float32 (it keeps its float32 output).
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(4))
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.matmul(F.softmax(scores, dim=-1).to(scores.dtype), v)
        want.float().sum().backward()
    assert kept == []
    assert torch.equal(out, want)
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


def test_a_model_with_a_16_bit_residual_stream_pickles_and_deep_copies():
    layer = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    cast_residual_stream([layer])
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert clone[0].forward.norm is clone[0]  # the copy's norm runs itself, not the original
        x = torch.randn(3, 8)
        torch.testing.assert_close(clone(x), layer(x))
    assert list(layer.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
