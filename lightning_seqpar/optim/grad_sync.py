"""Data-parallel gradient synchronization, owned by one object per run.

Megatron-Core's ``DistributedDataParallel`` is the model (``no_sync`` / ``start_grad_sync`` / ``finish_grad_sync``):
:class:`GradientSync` decides when a gradient is reduced and with what value. It holds the buckets of the run
(:class:`~lightning_seqpar.optim.grad_buckets.GradientBuckets` with ``zero=0``; each
:class:`~lightning_seqpar.optim.distributed_optimizer.DistributedOptimizer`'s sharded buckets with ``zero=1``), and
the accumulation window:

- batches before the last of a window accumulate locally (nothing is reduced: Megatron's ``no_sync``);
- :meth:`GradientSync.final_backward` spans the closure of an optimizer step, which runs the window's last backward:
  the buckets reduce as their gradients become final, and on leaving, every gradient is the unparallelized
  model's (``finish_grad_sync``), ready for clipping;
- under a pipeline schedule, whose backward passes run inside the training step, :meth:`GradientSync.schedule`
  gives the step a :class:`ScheduleGradients`: it keeps the window's earlier gradients aside, arms the buckets
  at each model chunk's last backward with ``earlier + scale · fresh`` (the value Lightning's backward of the
  returned loss would make), and hands back what the buckets did not take.

The strategy holds the one :class:`GradientSync` of a fit and hands the pipelined steps what :meth:`schedule` returns.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from lightning_seqpar.optim.distributed_optimizer import distribute_optimizers
from lightning_seqpar.optim.grad_buckets import BucketArming, Buckets, NoBuckets, gradient_buckets
from lightning_seqpar.optim.gradients import finalize_gradients
from lightning_seqpar.optim.whole_matrix import exact_or_refused
from lightning_seqpar.parallel.mesh import ParallelMesh


class ScheduleGradients:
    """The gradients of one pipelined training step (one batch of an accumulation window).

    Args:
        params: the module's trainable parameters.
        arming: the buckets to arm (the window's last batch), or ``None`` (an earlier batch, or a loss scaler whose
            factor lives on the device: the buckets then reduce after backward).
        scale: the loss's incoming gradient, ``1 / accumulate_grad_batches``.
        accumulated: earlier batches of the window left gradients (added to what the buckets reduce).
    """

    def __init__(self, params: Sequence[nn.Parameter], arming: Optional[BucketArming], scale: float,
                 accumulated: bool) -> None:
        self.params, self.arming, self.scale = list(params), arming, scale
        # An earlier batch's gradients stay aside while the schedule runs. At a window's first batch they are the last
        # step's, which Lightning's zero_grad drops after this training step: released now, they do not sit beside
        # the schedule's own gradients at its peak (one gradient per parameter, not two).
        self._earlier = [p.grad if accumulated else None for p in self.params]
        self._kept = ({id(p): g for p, g in zip(self.params, self._earlier) if g is not None}
                      if accumulated and arming is not None else {})
        for p in self.params:
            p.grad = None

    @property
    def reduces(self) -> bool:
        """Whether the buckets reduce during this schedule (the window's last batch)."""
        return self.arming is not None

    def arm(self, only: Optional[Iterable[nn.Parameter]]) -> None:
        """Just before a last backward: the buckets take ``only``'s gradients (``None``: every parameter's) as they
        become final, as ``earlier + scale · fresh``."""
        if self.arming is not None:
            self.arming.arm_in_schedule(self.scale, self._kept, only)

    def fresh(self) -> dict[nn.Parameter, Tensor]:
        """After the schedule: the earlier gradients back where the buckets did not take them, and the schedule's
        own gradients of those parameters (for the returned loss's backward to add, scaled)."""
        taken = self.arming.taken() if self.arming is not None else frozenset()
        fresh = {p: p.grad for p in self.params if p.grad is not None and id(p) not in taken}
        for p, grad in zip(self.params, self._earlier):
            if id(p) not in taken:
                p.grad = grad
        return fresh


class GradientSync:
    """The owner of data-parallel gradient reduction for one fit (see the module).

    Args:
        module: the rewritten model (its parameters, in model order).
        optimizers: the optimizers Lightning configured.
        lr_scheduler_configs: their schedulers (re-pointed at the distributed optimizers with ``zero=1``).
        mesh: the process groups; each gradient is reduced over the groups its placement names.
        zero: ``1``: :class:`DistributedOptimizer` for each optimizer (they reduce-scatter their own buckets);
            ``0``: the optimizers as they are, with all-reduce buckets over ``module``.
        pipelined: a pipeline schedule runs the backward passes (buckets armed per model chunk, not overlapped with
            the closure's backward).
        main_params: ``zero=1`` only: float32 main params of 16-bit parameters.

    Attributes:
        optimizers: the optimizers to step (distributed ones with ``zero=1``).

    Raises:
        ValueError: from :class:`DistributedOptimizer`; an optimizer that is not element-wise over split parameters
            (:func:`~lightning_seqpar.optim.whole_matrix.exact_or_refused`).
    """

    def __init__(self, module: nn.Module, optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any],
                 mesh: ParallelMesh, zero: int, pipelined: bool, main_params: bool = False) -> None:
        self.module, self.mesh = module, mesh
        self._window: Optional[BucketArming] = None
        optimizers = exact_or_refused(optimizers, lr_scheduler_configs, module, mesh)
        if zero:
            if main_params and not any(p.element_size() < 4 for p in module.parameters()):
                warnings.warn("fp32_main_params=True has no effect: the parameters are not 16-bit (precision="
                              "'bf16-mixed' keeps float32 parameters already). Use precision='bf16-true' for 16-bit "
                              "parameters with float32 main params.", stacklevel=2)
            distributed = distribute_optimizers(optimizers, lr_scheduler_configs, mesh, pipelined, main_params)
            self.optimizers: list[Optimizer] = list(distributed)
            self._replicated = _ReplicatedGradients(module, mesh, NoBuckets())
            self._owners: dict[int, Any] = {id(o): o for o in distributed}
        else:
            self.optimizers = list(optimizers)
            self._replicated = _ReplicatedGradients(module, mesh, gradient_buckets(module, mesh, pipelined))
            self._owners = {id(o): self._replicated for o in self.optimizers}

    @property
    def buckets(self) -> Buckets:
        """The all-reduce buckets over the module (``zero=0``; :class:`NoBuckets` with ``zero=1``)."""
        return self._replicated.buckets

    def replace_buckets(self, buckets: Buckets) -> None:
        """Reduce through ``buckets`` from now on (``zero=0``), the current ones released."""
        self._replicated.buckets.remove()
        self._replicated.buckets = buckets

    def remove(self) -> None:
        """Release the buckets' hooks (a later fit builds its own :class:`GradientSync`)."""
        self._replicated.remove()

    @classmethod
    def for_fit(cls, previous: Optional["GradientSync"], module: nn.Module, optimizers: Sequence[Optimizer],
                lr_scheduler_configs: Sequence[Any], mesh: ParallelMesh, layout: Any,
                pipelined: bool) -> "GradientSync":
        """A fit's :class:`GradientSync` from its layout's ``zero`` and ``fp32_main_params``
        (:class:`~lightning_seqpar.Layout`); ``previous`` (a fit before it on the same trainer) releases its hooks
        first."""
        if previous is not None:
            previous.remove()
        return cls(module, optimizers, lr_scheduler_configs, mesh, layout.zero, pipelined, layout.fp32_main_params)

    @contextmanager
    def final_backward(self, optimizer: Optimizer) -> Iterator[None]:
        """Around the closure of ``optimizer``'s step (it runs the window's last backward): the buckets reduce
        during that backward (or the schedule inside it); on leaving, the gradients are those of the unparallelized
        model. The owner of ``optimizer``'s gradients finishes them: a distributed optimizer keeps its owned ranges
        (:meth:`~lightning_seqpar.optim.DistributedOptimizer.finish_gradients`); otherwise the buckets are finished and
        :func:`~lightning_seqpar.optim.finalize_gradients` reduces the rest."""
        owner = self._owners.get(id(optimizer), self._replicated)
        with owner.buckets.reducing():
            self._window = owner.buckets
            try:
                yield
            finally:
                self._window = None
        owner.finish_gradients()

    def finalizing(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (it runs the window's last backward) run inside :meth:`final_backward`: the buckets reduce
        during its backward, and the gradients are final before clipping."""
        def closure_then_finalize() -> Any:
            with self.final_backward(optimizer):
                return closure()

        return closure_then_finalize

    def schedule(self, params: Sequence[nn.Parameter], batch_idx: int, accumulate: int,
                 device_scaled: bool) -> ScheduleGradients:
        """The gradients of a pipelined training step on batch ``batch_idx`` of windows of ``accumulate`` batches;
        the buckets are armed in it only inside :meth:`final_backward` and without a loss scaler
        (``device_scaled``: its factor lives on the device, so the buckets reduce after backward instead)."""
        arming = None if self._window is None or device_scaled else self._window
        return ScheduleGradients(params, arming, 1.0 / accumulate, batch_idx % accumulate != 0)


class _ReplicatedGradients:
    """The owner of the gradients of optimizers that update whole parameters (``zero=0``): all-reduce buckets over
    the module, then :func:`~lightning_seqpar.optim.finalize_gradients` for what they did not reduce. The same
    two members as a distributed optimizer (``buckets``, ``finish_gradients``), which owns its own.

    Several optimizers stepped after one backward (manual optimization: Muon beside AdamW) share these gradients:
    the first step finishes them, the next ones find no gradient written since and finish nothing again (a second
    sequence-parallel sum would double the norms' gradients; clipping between the steps writes in place, which is no
    new gradient). "Written" is told by a post-accumulate-grad hook on each trainable parameter: any backward that
    reaches it."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, buckets: Buckets) -> None:
        self.module, self.mesh, self.buckets = module, mesh, buckets
        self._written = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark) for p in module.parameters()
                       if p.requires_grad]

    def _mark(self, _: nn.Parameter) -> None:
        self._written = True

    def finish_gradients(self) -> None:
        if not self._written:
            return
        finalize_gradients(self.module.parameters(), self.mesh, self.buckets.finish())
        self._written = False

    def remove(self) -> None:
        """Release the buckets' hooks and the gradient marks."""
        self.buckets.remove()
        for hook in self._hooks:
            hook.remove()
