"""Where the tensor-parallel region starts and ends.

Inside the region activations are sequence-first and, under sequence parallelism, sharded along
the sequence: ``[s/t, b, h]``. The region is entered once (transpose a batch-first input, scatter
along s) and left once (gather along s, transpose back); consecutive rewritten layers pass the
shard to each other with no communication between them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


def check_sequence_length(s: int, group: ParallelGroup, where: str) -> None:
    """Raise ``ValueError`` if sequence parallelism cannot split a sequence of length ``s``."""
    if s % group.size:
        raise ValueError(
            f"{where}: sequence length {s} is not divisible by the tensor-parallel size {group.size}, "
            f"which sequence parallelism needs. Use a sequence length that is a multiple of {group.size}, "
            f"or `sequence_parallel=False`."
        )


def enter_parallel_region(x: Tensor, group: ParallelGroup, sequence_parallel: bool, batch_first: bool) -> Tensor:
    """``[b, s, h]`` (batch-first) or ``[s, b, h]`` → ``[s/t, b, h]`` under SP, else ``[s, b, h]``; contiguous, and so
    is its gradient (:func:`contiguous_both_ways`).

    Raises:
        ValueError: under SP if s is not divisible by t.
    """
    if batch_first:
        x = x.transpose(0, 1)
    if sequence_parallel and group.size > 1:
        check_sequence_length(x.shape[0], group, "Entering the sequence-parallel region")
        x = scatter_to_sequence_parallel_region(x, group)  # a contiguous copy of this rank's slice
    return contiguous_both_ways(x) if batch_first else x


def exit_parallel_region(x: Tensor, group: ParallelGroup, sequence_parallel: bool, batch_first: bool) -> Tensor:
    """Inverse of :func:`enter_parallel_region`: ``[s/t, b, h]`` → ``[b, s, h]`` or ``[s, b, h]``.

    What follows is replicated, so the backward of the gather keeps the local slice of the (identical)
    full gradients instead of reduce-scattering them.
    """
    if batch_first:
        x = contiguous_both_ways(x)  # (the gradient that enters the region, transposed back: contiguous)
    if sequence_parallel and group.size > 1:
        x = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False)
    if batch_first:
        x = x.transpose(0, 1)
    return x


class _ContiguousBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_both_ways(x: Tensor) -> Tensor:
    """``x`` contiguous, and its gradient too (a copy only where either is strided).

    Inside the region activations and gradients are ``[s/t, b, h]`` in that memory order. A batch-first input's
    transposed view would stay strided through every norm and residual add of the region, so each linear's ``[s·b,
    h]`` flattening would copy its input again and keep that copy for its weight gradient: three ``[s, b, h]`` more
    per layer at b > 1 where nothing copies the slice (t = 1, or no SP; at b = 1 the view is contiguous already).
    Megatron's embedding hands its layers ``transpose(0, 1).contiguous()`` too. The gradient arriving at the exit
    (a transposed view) is made contiguous the same way, so the region's backward sums (a bias's ``Σ dY``) run in one
    memory order whether its blocks are compiled (AOTAutograd makes incoming gradients contiguous) or eager. Under SP
    the scatter's and the gather's backward slices are copies already, of ``s/t`` rows: nothing more is copied, and no
    slice keeps a whole ``[s, b, h]`` alive.
    """
    return _ContiguousBothWays.apply(x)
