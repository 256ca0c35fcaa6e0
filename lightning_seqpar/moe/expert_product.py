"""Every local expert's projection of its rows, ``[R, in]`` → ``[R, out]``, with a backward that splits into B (the
rows' gradient) and W (the experts' weight gradient) while a :class:`~lightning_seqpar.tensor_parallel.
weight_gradients.WeightGradientStore` is deferring: the experts' part of a zero-bubble schedule's W (Qi et al.,
*Zero Bubble Pipeline Parallelism*, ICLR 2024, §2), as the column- and row-parallel linears have theirs.

Two ways to compute, chosen by the caller and used alike forward and backward:

- grouped (``offsets`` given): ``torch.nn.functional.grouped_mm`` over the rows grouped by expert; the weight
  gradient is one grouped GEMM of the rows' transpose by the output gradient over the same offsets (the product
  torch's own backward of ``grouped_mm`` makes for its right operand);
- a loop over the experts (``sizes`` given: float64, unaligned widths), one GEMM each.

Either way W computes exactly the weight-gradient GEMM from what B kept (the rows and the output gradient), hands it
to autograd on the parameter (accumulated into ``.grad``, its hooks fired at W), and an expert given no rows gets a
zero gradient. Without a store, or outside its ``deferring``, the backward returns both gradients at once.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore, accumulate


class PackedLayout(Protocol):
    """How a parameter stored otherwise holds every expert's ``[out, in]`` matrix (a LoRA adapter's ``B``, expert-minor:
    :mod:`.expert_adapter`): made into ``[E/e, out, in]`` when a product reads it, forward and backward alike, so no
    rearranged copy of it is kept for backward."""

    def experts(self, parameter: Tensor) -> Tensor:
        """``[E/e, out, in]`` (contiguous where the grouped GEMM reads it)."""

    def gradient(self, experts: Tensor) -> Tensor:
        """The parameter's gradient from its ``[E/e, out, in]`` one."""


def expert_product(rows: Tensor, weight: Tensor, transposed: bool, store: Optional[WeightGradientStore], *,
                   offsets: Optional[Tensor] = None, sizes: Optional[Sequence[int]] = None,
                   dtype: Optional[torch.dtype] = None, bias: Optional[Tensor] = None,
                   packed: Optional[PackedLayout] = None) -> Tensor:
    """``rows`` ``[R, in]`` grouped by local expert times each expert's ``weight`` (``[E/e, out, in]``, or
    ``[E/e, in, out]`` when ``transposed``) → ``[R, out]``.

    Args:
        offsets: the grouped GEMM's end offsets ``[E/e]`` (int32, on the rows' device); or
        sizes: each expert's row count (the loop).
        bias: ``[E/e, out]``, with ``sizes`` only: added in each expert's GEMM as the unsplit loop adds it (its
            gradient in B); the grouped path adds its bias outside.
        dtype: the compute dtype (the weight is cast to it, as autocast would); default: the rows'.
        store: where W goes while it is deferring (``None``: never split).
        packed: ``weight`` is stored otherwise and made ``[E/e, out, in]`` by it (not ``transposed``).
    """
    return _ExpertProduct.apply(rows, weight, bias, transposed, store, offsets,
                                tuple(sizes) if sizes is not None else None, dtype or rows.dtype, packed)


def _forward(rows: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool, offsets: Optional[Tensor],
             sizes: Optional[tuple[int, ...]]) -> Tensor:
    if offsets is not None:
        return F.grouped_mm(rows, weight if transposed else weight.transpose(-2, -1), offs=offsets)
    outputs = [_linear(chunk, weight[i], None if bias is None else bias[i], transposed)
               for i, chunk in enumerate(rows.split(list(sizes)))]
    return torch.cat(outputs) if outputs else rows.new_empty(0, weight.shape[-1 if transposed else -2])


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    if transposed:  # as the experts' own loop computes it (moe/experts.py)
        return x @ weight if bias is None else torch.addmm(bias, x, weight)
    return F.linear(x, weight, bias)


def _input_gradient(grad: Tensor, weight: Tensor, transposed: bool, offsets: Optional[Tensor],
                    sizes: Optional[tuple[int, ...]]) -> Tensor:
    if offsets is not None:
        return F.grouped_mm(grad, weight.transpose(-2, -1) if transposed else weight, offs=offsets)
    chunks = [g.matmul(weight[i].t() if transposed else weight[i]) for i, g in enumerate(grad.split(list(sizes)))]
    return torch.cat(chunks)


def _weight_gradient(rows: Tensor, grad: Tensor, shape: torch.Size, transposed: bool, offsets: Optional[Tensor],
                     sizes: Optional[tuple[int, ...]]) -> Tensor:
    if offsets is not None:
        right = F.grouped_mm(rows.t(), grad, offs=offsets)  # [E/e, in, out]: each expert's rowsᵀ · dY
        return right if transposed else right.transpose(-2, -1)
    out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)  # an expert without rows: zeros
    for i, (x, g) in enumerate(zip(rows.split(list(sizes)), grad.split(list(sizes)))):
        if x.shape[0]:
            out[i] = x.t().matmul(g) if transposed else g.t().matmul(x)
    return out


class _ExpertProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool,
                store: Optional[WeightGradientStore], offsets: Optional[Tensor], sizes: Optional[tuple[int, ...]],
                dtype: torch.dtype, packed: Optional[PackedLayout]) -> Tensor:
        ctx.transposed, ctx.store, ctx.offsets, ctx.sizes = transposed, store, offsets, sizes
        ctx.weight, ctx.rows_dtype = weight, rows.dtype  # the parameter: what W hands its gradient to
        ctx.bias_shape, ctx.packed = None if bias is None else bias.shape, packed
        rows = rows.to(dtype)
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None)  # for the weight gradient only (frozen: none)
        experts = weight if packed is None else packed.experts(weight)
        return _forward(rows, experts.to(dtype), None if bias is None else bias.to(dtype), transposed, offsets, sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        (rows,), parameter, packed = ctx.saved_tensors, ctx.weight, ctx.packed
        weight = parameter if packed is None else packed.experts(parameter)  # made again, not kept
        grad = grad.contiguous()
        compute = grad.dtype
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = _input_gradient(grad, weight.to(compute), ctx.transposed, ctx.offsets, ctx.sizes)
            grad_rows = grad_rows.to(ctx.rows_dtype)
        grad_bias = None
        if ctx.needs_input_grad[2]:  # each expert's rows' gradients summed, in B
            grad_bias = grad.new_zeros(ctx.bias_shape)
            for i, g in enumerate(grad.split(list(ctx.sizes))):
                if g.shape[0]:
                    grad_bias[i] = g.sum(0)
        rest = (None,) * 6  # transposed, store, offsets, sizes, dtype, packed
        if not ctx.needs_input_grad[1]:
            return (grad_rows, None, grad_bias, *rest)
        transposed, offsets, sizes = ctx.transposed, ctx.offsets, ctx.sizes
        shape = weight.shape
        del weight  # W reads the rows and the output gradient only

        def weight_gradient() -> Tensor:
            experts = _weight_gradient(rows.to(compute), grad, shape, transposed, offsets, sizes)
            return (experts if packed is None else packed.gradient(experts)).to(parameter.dtype)

        if ctx.store is not None and ctx.store.is_deferring:
            ctx.store.defer(lambda: accumulate([parameter], [weight_gradient()]))
            return (grad_rows, None, grad_bias, *rest)
        return (grad_rows, weight_gradient(), grad_bias, *rest)
