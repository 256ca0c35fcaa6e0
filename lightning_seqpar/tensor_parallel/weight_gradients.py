"""The backward of a parallel linear split in two: B, the input gradient (on a pipeline's critical path), and W, the
weight gradient (schedulable anywhere later) — what zero-bubble pipeline schedules place (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024, §2 and its ``WeightGradStore``).

torch's own split (``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``) re-runs a
custom autograd function's whole backward for W: on a column-parallel linear that is the input-gradient GEMM again and
every tensor-parallel collective again. Ours is inside our layers' functions
(:mod:`lightning_seqpar.tensor_parallel.layers`): while a :class:`WeightGradientStore` is :meth:`~WeightGradientStore.
deferring`, their backward computes the input gradient and starts its reduction (B), and leaves the weight gradient
as a closure that computes exactly the weight GEMM from what B kept: the output gradient ``[s, b, out/t]`` and the
input — under sequence parallelism its local shard ``[s/t, b, in]``, re-gathered in W (the all-gather the unsplit
backward makes for the same GEMM moves there: the count of collectives is unchanged). W hands the gradient to autograd
(``torch.autograd.backward`` on the weight tensor), so it accumulates into ``.grad`` exactly as the unsplit backward
does and every hook that watches accumulation (gradient buckets, their overlapped data-parallel reduction) fires at W.
A frozen weight has no W.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor


class WeightGradientStore:
    """The W halves of deferred backwards, one group per B (a stage's backward of one micro-batch), run oldest first.

    One store per pipeline stage; the layers that split their backward hold it (:func:`split_weight_gradients`), and
    whoever runs the schedule opens :meth:`deferring` around each B and calls :meth:`run` for each W. No global state:
    outside :meth:`deferring` the layers' backward is the unsplit one.
    """

    def __init__(self) -> None:
        self._queue: deque[list[Callable[[], None]]] = deque()
        self._open: Optional[list[Callable[[], None]]] = None

    @property
    def is_deferring(self) -> bool:
        """Whether a backward now leaves its weight gradients here (inside :meth:`deferring`)."""
        return self._open is not None

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Within this context the split layers' backwards compute B only; their W halves form one group, queued
        when the context ends (also when the backward raised: nothing of a group is lost or run twice).

        Raises:
            RuntimeError: when already deferring (one B at a time per stage).
        """
        if self._open is not None:
            raise RuntimeError("WeightGradientStore.deferring() entered twice: one B at a time per pipeline stage.")
        self._open = []
        try:
            yield
        finally:
            group, self._open = self._open, None
            self._queue.append(group)

    def defer(self, weight_gradient: Callable[[], None]) -> None:
        """Leave ``weight_gradient`` (a W half) in the group of the B now running."""
        assert self._open is not None, "defer() outside deferring()"
        self._open.append(weight_gradient)

    @property
    def pending(self) -> int:
        """The B's whose W has not run yet."""
        return len(self._queue)

    def run(self) -> int:
        """Run the W of the oldest pending B (its halves in the order its backward left them); return how many.

        Raises:
            RuntimeError: no W pending (a schedule with more W than B).
        """
        if not self._queue:
            raise RuntimeError("WeightGradientStore.run(): no weight gradient is pending (a W without its B).")
        group = self._queue.popleft()
        for weight_gradient in group:
            weight_gradient()
        return len(group)


def accumulate(tensors: Sequence[Optional[Tensor]], gradients: Sequence[Optional[Tensor]]) -> None:
    """Hand ``gradients`` to autograd for ``tensors`` (parameters, or views of them such as a Conv1D weight's
    transpose), as the unsplit backward would have: accumulated into ``.grad`` by autograd, its hooks fired."""
    pairs = [(t, g) for t, g in zip(tensors, gradients) if t is not None and g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def split_weight_gradients(model: nn.Module, store: Optional[WeightGradientStore]) -> int:
    """Make every column- and row-parallel linear of ``model`` split its backward into B and W through ``store``
    (``None``: unsplit again); return how many layers were set."""
    from lightning_seqpar.tensor_parallel.layers import (ColumnParallelInProjection, ColumnParallelLinear,
                                                         RowParallelLinear)

    layers = [m for m in model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ColumnParallelInProjection))]
    for layer in layers:
        layer.weight_gradients = store
    return len(layers)
