"""A loss summed over the context-parallel ranks, each of which computed it over its own tokens."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup


class _SumOverContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: ParallelGroup) -> Tensor:
        ctx.c = group.size
        return group.all_reduce(partial.detach().clone())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None]:
        # Every cp rank backpropagates the same summed loss, so ∂L/∂partial_r, summed over the ranks holding L, is
        # c · grad: an all-reduce of identical values, done without communicating. The gradient buckets then average
        # over the d·c ranks of the data group, which leaves the cp ranks' sum (Megatron-LM scales by cp the same way).
        return grad * ctx.c, None


def sum_over_context(partial: Tensor, group: ParallelGroup) -> Tensor:
    """``Σ_r partial_r`` over the cp group (every rank gets the value of the whole sequence's loss, for logging as for
    backward). ``partial``: this rank's tokens' share, e.g. their loss sum divided by the whole sequence's token
    count: the result is then the token-weighted mean of one process, however ``-100`` labels fall across ranks."""
    if group.size == 1:
        return partial
    return _SumOverContext.apply(partial, group)
