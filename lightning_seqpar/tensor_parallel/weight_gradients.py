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
backward makes for the same GEMM moves there: the count of collectives is unchanged). W accumulates the gradient into
``.grad`` exactly as the unsplit backward's autograd does (in place, then the post-accumulate-grad hooks:
:func:`accumulate`), so every hook that watches accumulation (gradient buckets, their overlapped data-parallel
reduction) fires at W. A frozen weight has no W.

torch calls a parameter's post-accumulate-grad hooks in B as well, with ``.grad`` unchanged (the function returned no
gradient for it): ``None``, or what earlier W's accumulated. A hook that takes gradients must not act on that call: the
data-parallel buckets skip a ``None`` and are armed for these parameters only before a chunk's last W
(:mod:`lightning_seqpar.lightning.pipelined_steps`), after its last B.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar._compat import has_gradient_hooks, run_post_accumulate_grad_hooks


class WeightGradientStore:
    """The W halves of deferred backwards, one group per B (a stage's backward of one micro-batch), each run once: by
    its key, or oldest first.

    One store per pipeline rank; the layers that split their backward hold it
    (:func:`~lightning_seqpar.tensor_parallel.split_backward.split_weight_gradients`), and whoever runs the schedule
    opens :meth:`deferring` around each B and calls :meth:`run` for each W. No global state: outside :meth:`deferring`
    the layers' backward is the unsplit one.
    """

    def __init__(self) -> None:
        self.deferred: set[int] = set()  # id() of the parameters whose gradient W hands over (split_weight_gradients)
        self._groups: dict[Hashable, list[Callable[[], None]]] = {}  # in the order their B's ran
        self._open: Optional[list[Callable[[], None]]] = None
        self._count = 0

    @property
    def is_deferring(self) -> bool:
        """Whether a backward now leaves its weight gradients here (inside :meth:`deferring`)."""
        return self._open is not None

    @contextlib.contextmanager
    def deferring(self, key: Hashable = None) -> Iterator[None]:
        """Within this context the split layers' backwards compute B only; their W halves form one group under
        ``key`` (default: a number of its own), stored when the context ends (also when the backward raised: nothing
        of a group is lost or run twice).

        Raises:
            RuntimeError: when already deferring (one B at a time per rank), or ``key`` is pending already.
        """
        if self._open is not None:
            raise RuntimeError("WeightGradientStore.deferring() entered twice: one B at a time per pipeline rank.")
        if key is None:
            key, self._count = ("B", self._count), self._count + 1
        if key in self._groups:
            raise RuntimeError(f"WeightGradientStore: the W of {key!r} is still pending; run it before its next B.")
        self._open = []
        try:
            yield
        finally:
            self._groups[key], self._open = self._open, None

    def defer(self, weight_gradient: Callable[[], None]) -> None:
        """Leave ``weight_gradient`` (a W half) in the group of the B now running."""
        assert self._open is not None, "defer() outside deferring()"
        self._open.append(weight_gradient)

    @property
    def pending(self) -> int:
        """The B's whose W has not run yet."""
        return len(self._groups)

    def run(self, key: Hashable = None) -> int:
        """Run the W of the B stored under ``key`` (default: the oldest pending), its halves in the order its backward
        left them; return how many.

        Raises:
            RuntimeError: no such W pending (a schedule with a W before its B, or two W's of one B).
        """
        if key is None:
            key = next(iter(self._groups), None)
        if key not in self._groups:
            raise RuntimeError(f"WeightGradientStore.run({key!r}): no weight gradient is pending for it (a W without "
                               f"its B).")
        group = self._groups.pop(key)
        with torch.no_grad():  # as inside the backward it was split from (a collective writes into its output)
            for weight_gradient in group:
                weight_gradient()
        return len(group)


def accumulate(tensors: Sequence[Optional[Tensor]], gradients: Sequence[Optional[Tensor]]) -> None:
    """Add ``gradients`` to ``tensors``' ``.grad`` as the unsplit backward's autograd would have: in place
    (``grad += gradient``, autograd's own accumulation, so the sum is bit for bit the unsplit backward's), then the
    tensor's post-accumulate-grad hooks, as autograd's accumulation calls them.

    autograd's engine, started once per weight, costs more than the GEMM of a small layer, and W starts it for every
    projection of every micro-batch; torch's FSDP2 accumulates the same way after its reduce-scatter
    (``_fsdp_collectives.py``: add into ``.grad``, then the parameter's post-accumulate-grad hooks). autograd
    keeps what it must do itself: a tensor's first gradient (placed by its layout rules), a tensor that is not a plain
    leaf parameter (a view such as a Conv1D weight's transpose, a tensor subclass), one whose gradient hooks
    (``register_hook``) must see the gradient before it is added."""
    engine = [(t, g) for t, g in zip(tensors, gradients) if t is not None and g is not None and not _add_in_place(t, g)]
    if engine:
        torch.autograd.backward([t for t, _ in engine], [g for _, g in engine])


def _direct(tensor: Tensor) -> bool:
    """Whether ``tensor``'s gradient may be added outside autograd: a leaf that requires it, of torch's own tensor
    classes, with no gradient pre-hooks (``register_hook``)."""
    return (tensor.is_leaf and tensor.requires_grad and type(tensor) in (nn.Parameter, Tensor)
            and not has_gradient_hooks(tensor))


def _add_in_place(tensor: Tensor, gradient: Tensor) -> bool:
    """``tensor.grad += gradient`` with the hooks after; ``False`` where autograd must do it (:func:`_direct`; no
    gradient yet, whose first one autograd places by its own layout rules; a gradient of another dtype or shape)."""
    if not _direct(tensor):  # (a view's .grad is not read: torch warns on it)
        return False
    grad = tensor.grad
    if grad is None or not (grad.dtype == gradient.dtype and grad.shape == gradient.shape
                                                   and grad.is_contiguous() and gradient.layout == torch.strided):
        return False
    grad.add_(gradient)
    run_post_accumulate_grad_hooks(tensor)
    return True

