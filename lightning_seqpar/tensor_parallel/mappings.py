"""The conjugate communication operators of tensor and sequence parallelism.

Names follow Korthikanti et al. 2022 (Figs. 4-5) and Megatron-LM ``mappings.py``:

==================================================  ==============================  ==============================
operator                                            forward                         backward
==================================================  ==============================  ==============================
f   :func:`copy_to_tensor_parallel_region`          identity                        all-reduce
f̄   :func:`reduce_from_tensor_parallel_region`      all-reduce                      identity
g   :func:`gather_from_sequence_parallel_region`    all-gather along s              reduce-scatter along s
ḡ   :func:`reduce_scatter_to_sequence_parallel_region`  reduce-scatter along s      all-gather along s
    :func:`scatter_to_sequence_parallel_region`     split along s                   all-gather along s
    :func:`gather_from_tensor_parallel_region`      all-gather along the last dim   split along the last dim
==================================================  ==============================  ==============================

Activations are sequence-first, ``[s, b, h]``, so the sequence dimension is dim 0 and its collectives
are contiguous. On a group of one rank every operator is the identity.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: copy in forward, all-reduce in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.group.all_reduce(grad.clone()), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """f̄: all-reduce in forward, copy in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        return group.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g: all-gather along s in forward; reduce-scatter (or split) in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup, tensor_parallel_output_grad: bool) -> Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return group.all_gather(x, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.tensor_parallel_output_grad:
            return ctx.group.reduce_scatter(grad), None, None
        # What follows the gather was replicated: every rank holds the same full gradient.
        return ctx.group.split(grad, dim=0), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """ḡ: reduce-scatter along s in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        ctx.group = group
        return group.reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.group.all_gather(grad, dim=0), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split along s in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        ctx.group = group
        return group.split(x, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.group.all_gather(grad, dim=0), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension in forward, split in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        ctx.group = group
        return group.all_gather(x, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.group.split(grad, dim=grad.dim() - 1), None


def copy_to_tensor_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """f: identity forward, all-reduce of the gradient backward. Shape unchanged."""
    if group.size == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


class _SumOverTensorParallelRegion(torch.autograd.Function):
    """All-reduce in forward and in backward: a sum every rank uses, so each rank's part of it receives the gradients
    of all the ranks' uses."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup) -> Tensor:
        ctx.group = group
        return group.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.group.all_reduce(grad.clone()), None


def sum_over_tensor_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """The sum of ``x`` over the tensor-parallel group, on every rank, differentiable as such (all-reduce forward and
    backward; e.g. the sum of squares of a norm whose features are split over tp). Shape unchanged."""
    if group.size == 1:
        return x
    return _SumOverTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """f̄: all-reduce (sum) forward, identity backward. Shape unchanged."""
    if group.size == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: Tensor, group: ParallelGroup, tensor_parallel_output_grad: bool = True
) -> Tensor:
    """g: ``[s/t, ...]`` → ``[s, ...]`` by all-gather; backward reduce-scatters.

    Args:
        tensor_parallel_output_grad: ``True`` when what consumes the output is tensor-parallel (each
            rank contributes a partial gradient, which must be summed: reduce-scatter). ``False`` when it
            is replicated (every rank holds the full gradient: take the local slice), as where the
            parallel region ends (Megatron-LM ``gather_from_sequence_parallel_region``).
    """
    if group.size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """ḡ: partial sums ``[s, ...]`` → summed local shard ``[s/t, ...]``; backward all-gathers."""
    if group.size == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """Replicated ``[s, ...]`` → local shard ``[s/t, ...]``; backward all-gathers.

    Raises:
        ValueError: if s is not divisible by the group size.
    """
    if group.size == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: Tensor, group: ParallelGroup) -> Tensor:
    """``[..., n/t]`` → ``[..., n]`` by all-gather on the last dim; backward keeps the local slice."""
    if group.size == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)
