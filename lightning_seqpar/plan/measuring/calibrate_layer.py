"""The element-wise rates of the step-time model (``StepCalibration.memory`` and ``.dispatch``), measured on a decoder
layer as Hugging Face writes a Llama's, not on a clean in-place add.

A model's element-wise operators are not an add over large contiguous tensors: they broadcast (a norm's ``rsqrt`` over
``[b, s, 1]``, rotary ``cos``/``sin`` over the batch), allocate their outputs (on CPU a fresh multi-megabyte tensor
is page-faulted in), and some are bound by arithmetic (the softmax's ``exp``). On 2 CPU cores the add ran at
64 GB/s while a small Llama's element-wise operators moved their counted bytes at about a quarter of that: the planner
had priced them at 24 ms of a 0.49 s step where they took about 100 ms. Views (a transpose, a reshape) cost a
dispatch and launch no kernel, and a layer has many: a chain without them charged a host-bound step on an H200 for
1.27 × its measured time.

So one fully written layer (:class:`ReferenceLayer`: RMSNorm in float32 operations, rotary embedding, core
attention, SwiGLU MLP, two residual adds) runs forward and backward at two sizes: a tiny one
(its operators' dispatch is nearly all its time) and one of a model's size on this device (its bytes and FLOPs are).
From each time the planner's own price of its GEMMs and core attention (the calibration's measured rates) is taken
away; what is left is ``operators × dispatch + bytes / memory`` on CPU, where both take their turn, and on a device that
queues kernels the host's dispatch at the tiny size and the bytes' time at the large one
(:meth:`~.calibration.StepCalibration.elementwise_seconds`). Operators and bytes are
:class:`~.work.OperatorCounter`'s, as the planner counts a model's.

The same tiny layer runs once more with its seven projections' backward split into B and W (the layers' own
autograd functions in place of torch's linear, each W a closure accumulating its gradient,
:mod:`lightning_seqpar.tensor_parallel.weight_gradients`): what a zero-bubble schedule adds on the host, per
projection and micro-batch (``StepCalibration.split``).

Its core attention is the device's usual one: on CUDA the fused kernel (``scaled_dot_product_attention``, the
``sdpa`` Hugging Face loads by default), priced at the rate measured on that same kernel; on CPU the explicit
``softmax(QKᵀ·scale + mask)·V`` (``attn_implementation="eager"``, what ``recipes/plan_check.py`` trains), its
scores' operators part of the element-wise work. Explicit attention on an H200 left its batched GEMMs' time beyond
the fused kernel's rate in the residual: 2.4 TB/s of element-wise work, and a 1B Llama under SDPA planned at
1.17 × its measured step.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from lightning_seqpar.tensor_parallel.layers import split_product
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

PROJECTIONS = 7
"""q, k, v, o, gate, up and down: the projections of :class:`ReferenceLayer`."""

LAYER_SIZES = {  # (b, s, h, heads, f): the tiny layer, then one of a model's size on this kind of device
    "cpu": ((1, 8, 16, 2, 32), (2, 256, 256, 8, 1024)),
    "cuda": ((1, 8, 16, 2, 32), (1, 4096, 2048, 16, 8192)),
}


class ReferenceLayer(torch.nn.Module):
    """A Llama decoder layer (Hugging Face's operators, in its order): ``x [b, s, h] → [b, s, h]``; ``fused``: core
    attention by ``scaled_dot_product_attention`` (causal), else explicit with ``mask [1, 1, s, s]``; ``store``: its
    :data:`PROJECTIONS` projections split their backward into B and W through it, as under a zero-bubble schedule."""

    def __init__(self, h: int, heads: int, f: int, fused: bool = False, store: Optional[WeightGradientStore] = None):
        super().__init__()
        self.heads, self.head_dim, self.fused, self.store = heads, h // heads, fused, store
        self.qkvo = torch.nn.ModuleList(torch.nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate_up = torch.nn.ModuleList(torch.nn.Linear(h, f, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(f, h, bias=False)
        self.norms = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(h)) for _ in range(2))

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * hidden.to(x.dtype)

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self._norm(x, self.norms[0])
        q, k, v = (self._project(proj, y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for proj in self.qkvo[:3])
        q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
        if self.fused:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5 + mask
            attended = torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
        attended = attended.transpose(1, 2).reshape(b, s, h)
        x = x + self._project(self.qkvo[3], attended)
        y = self._norm(x, self.norms[1])
        gate, up = (self._project(proj, y) for proj in self.gate_up)
        return x + self._project(self.down, F.silu(gate) * up)

    def _project(self, proj: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(x) if self.store is None else split_product(x, proj.weight, self.store)


def layer_step(size: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype,
               fused: Optional[bool] = None, split: bool = False) -> tuple[Callable[[], None], float, float]:
    """``(step, GEMM FLOPs, core-attention FLOPs)`` of one forward and backward of a :class:`ReferenceLayer` of
    ``size = (b, s, h, heads, f)`` on ``device`` (``fused`` attention; default: on CUDA): GEMMs
    ``6·b·s·(4h² + 3hf)``, attention ``12·b·s²·h`` (as the planner counts them:
    :func:`~..pricing.cost.attention_flops`). ``split``: the backward split into B, then W (the same FLOPs)."""
    b, s, h, heads, f = size
    generator = torch.Generator().manual_seed(0)
    store = WeightGradientStore() if split else None
    layer = ReferenceLayer(h, heads, f, fused=device.type == "cuda" if fused is None else fused, store=store)
    layer = layer.to(device, dtype)
    x = torch.randn(b, s, h, generator=generator).to(device, dtype).requires_grad_()
    angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.ones(h // heads)[None, :] / 100
    cos, sin = (fn(angles).to(device, dtype)[None, None] for fn in (torch.cos, torch.sin))
    mask = torch.full((s, s), -math.inf, device=device, dtype=dtype).triu(1)[None, None]
    grad = torch.randn(b, s, h, generator=generator).to(device, dtype)

    def step() -> None:
        out = layer(x, cos, sin, mask)
        if store is None:
            out.backward(grad)
            return
        with store.deferring():
            out.backward(grad)
        store.run()

    return step, 6.0 * b * s * (4 * h * h + 3 * h * f), 12.0 * b * s * s * h
