"""Data-parallel gradient reduction in contiguous buckets, each started as soon as its last gradient is ready.

PyTorch DDP's reducer and Megatron-LM's ``DistributedDataParallel(overlap_grad_reduce=True)``: parameters are
grouped, in the reverse of their order in the model (the order backward produces their gradients), into buckets of
at most ``bucket_bytes``, each with one flat buffer. While armed (the last backward of an accumulation window), the
moment autograd has accumulated a parameter's gradient its values are copied into its slice of the bucket's buffer
and ``param.grad`` becomes that slice; when a bucket's last gradient arrives, its all-reduce over its parameters' data
replicas (:class:`Replicas`: the group their placement names, ``dp_cp`` for dense weights) starts, and runs while backward goes on through the earlier layers. :meth:`GradientBuckets.finish` waits for
them and averages. Gradients are reduced in float32 where they are 16-bit (the buffer is float32; the averaged
values are copied back). Under a pipeline schedule, whose backward passes run inside the training step, the hooks
are armed just before this rank's last backward of the schedule (:meth:`BucketArming.arm_in_schedule`);
:meth:`GradientBuckets.finish` fills and starts whatever backward did not. A bucket some of whose parameters got no
gradient is never started: those gradients are reduced afterwards with the rest
(:func:`~lightning_seqpar.optim.finalize_gradients`).

The buffers are the only copy of the gradients that persists (a ``torch.cat`` of all gradients, as a whole-model
coalesced all-reduce makes, would double them during the reduction).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.optim.gradients import shared_over_stages
from lightning_seqpar.parallel.collectives import ParallelGroup, Pending
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import placement_of

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb


@dataclass(frozen=True)
class Replicas:
    """Where each parameter's data replicas are, and what their summed gradient is divided by.

    Attributes:
        group_of: the group a parameter's gradient is summed over (its placement's ``replicated_over``).
        divisor: the number of data replicas d·c (the same for every parameter: an expert's gradient summed over
            its expert data-parallel group already holds the tokens of every replica, Megatron-Core's expert
            gradient scaling).
    """

    group_of: Callable[[nn.Parameter], ParallelGroup]
    divisor: int

    @classmethod
    def of_mesh(cls, mesh: ParallelMesh) -> "Replicas":
        """Each parameter's ``replicated_over`` group of ``mesh``; divided by d·c."""
        return cls(lambda p: mesh.group(placement_of(p).replicated_over), mesh.replicas)

    @classmethod
    def over(cls, group: ParallelGroup) -> "Replicas":
        """Every parameter over ``group``, averaged over it."""
        return cls(lambda p: group, group.size)

    def trivial(self, params: Iterable[nn.Parameter]) -> bool:
        """Whether nothing is communicated or scaled for ``params``."""
        return self.divisor == 1 and all(self.group_of(p).size == 1 for p in params)


def as_replicas(data: Union[ParallelGroup, Replicas]) -> Replicas:
    """``data`` as :class:`Replicas` (a group: every parameter averaged over it)."""
    return data if isinstance(data, Replicas) else Replicas.over(data)


class _Bucket:
    """Parameters reduced together over ``group``, and their buffer ``[rows, S]``: parameter i owns columns
    ``offsets[i] : offsets[i] + widths[i]`` with ``widths[i] = ceil(numel / rows)`` (``rows = 1``: a flat buffer for an
    all-reduce; ``rows = d``: one row per data-parallel rank for a reduce-scatter). float32 for 16-bit parameters."""

    def __init__(self, params: list[nn.Parameter], group: ParallelGroup, rows: int = 1) -> None:
        self.params, self.group = params, group
        dtype = params[0].dtype
        self.reduce_dtype = torch.float32 if dtype.itemsize < 4 else dtype
        self.widths = [-(-p.numel() // rows) for p in params]
        self.offsets, total = [], 0
        for k in self.widths:
            self.offsets.append(total)
            total += k
        self.width = total  # S
        self.buffer = torch.zeros(rows, total, dtype=self.reduce_dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.pending: Optional[Pending] = None

    def slice(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of a one-row buffer, shaped like it."""
        p = self.params[index]
        return self.buffer[0, self.offsets[index]:self.offsets[index] + p.numel()].view_as(p)


class BucketArming:
    """When bucket hooks act, and on what value: shared by :class:`GradientBuckets` and the distributed optimizer's
    buckets.

    :meth:`window` spans the closure of an optimizer step (the last batch of an accumulation window); the hooks act
    during its backward when the buckets overlap (no pipeline). Under a pipeline schedule the backward passes run
    inside the training step, one per micro-batch, and the gradient Lightning will see is ``earlier + scale ·
    fresh`` (gradients accumulated by the window's earlier batches, and the schedule's, scaled by the loss's
    incoming gradient): :meth:`arm_in_schedule`, called just before the schedule's last backward on this rank, makes
    the hooks reduce that value, so each bucket starts as its gradients become final.
    """

    overlap: bool
    armed: bool = False
    window_end: bool = False
    _scale: float = 1.0
    _earlier: Mapping[int, Tensor] = MappingProxyType({})  # immutable: a class default shared by every instance
    _only: Optional[set[int]] = None  # armed for these parameters only (None: all)

    @contextmanager
    def window(self) -> Iterator[None]:
        """The closure of an optimizer step: hooks armed at once if the buckets overlap backward."""
        self.window_end, self.armed, self._scale, self._earlier, self._only = True, self.overlap, 1.0, MappingProxyType({}), None
        try:
            yield
        finally:
            self.window_end, self.armed, self._earlier, self._only = False, False, MappingProxyType({}), None

    def arm_in_schedule(self, scale: float, earlier: Mapping[int, Tensor],
                        only: Optional[Iterable[nn.Parameter]] = None) -> bool:
        """Inside :meth:`window` only: the hooks reduce ``earlier[id(p)] + scale · p.grad`` from now on, for the
        parameters ``only`` (added to those armed before; ``None``: every parameter). Returns whether they were
        armed."""
        if not self.window_end:
            return False
        if only is None:
            self._only = None
        elif not self.armed or self._only is not None:
            self._only = (self._only or set()) | set(map(id, only))
        self.armed, self._scale, self._earlier = True, scale, earlier
        return True

    def _acts_on(self, param: nn.Parameter) -> bool:
        return self.armed and param.grad is not None and (self._only is None or id(param) in self._only)

    def _value(self, param: nn.Parameter) -> Tensor:
        """The gradient a hook reduces for ``param`` (its accumulated ``.grad``, or the schedule's combination)."""
        grad = param.grad
        assert grad is not None
        if self._scale != 1.0:
            grad = grad * self._scale
        earlier = self._earlier.get(id(param))
        return grad if earlier is None else earlier + grad

    def taken(self) -> frozenset[int]:
        """The ``id`` of every parameter a hook has taken in this window (none outside one)."""
        return self._taken() if self.window_end else frozenset()

    def _taken(self) -> frozenset[int]:
        raise NotImplementedError


class HookedBuckets(BucketArming):
    """Buckets over parameters and the post-accumulate-grad hooks that fill them (a subclass says how: ``_bucket``,
    ``_ready``): parameters in the reverse of model order (the order backward produces their gradients), a new
    bucket at ``bucket_bytes`` of buffer, at a change of dtype, device or replica group, and between ``apart``
    parameters and the others; tied parameters once. ``rows``: buffer rows per bucket (its group's size, or 1)."""

    replicas: Replicas
    buckets: list

    def _form(self, params: Iterable[nn.Parameter], replicas: Replicas, overlap: bool, bucket_bytes: int,
              sharded: bool = False, apart: frozenset[int] = frozenset()) -> None:
        self.replicas, self.overlap = replicas, overlap
        self.buckets, self._where = [], {}
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        group: list[nn.Parameter] = []
        size = 0
        for p in reversed(unique):
            over = replicas.group_of(p)
            rows = over.size if sharded else 1
            nbytes = -(-p.numel() // rows) * rows * max(4, p.element_size())
            if group and (size + nbytes > bucket_bytes or p.dtype != group[0].dtype or p.device != group[0].device
                          or over is not replicas.group_of(group[0]) or (id(p) in apart) != (id(group[0]) in apart)):
                self._add(group)
                group, size = [], 0
            group.append(p)
            size += nbytes
        if group:
            self._add(group)
        this = weakref.ref(self)  # the hooks must not keep replaced buckets alive (a second fit)

        def ready(param: nn.Parameter) -> None:
            buckets = this()
            if buckets is not None:
                buckets._ready(param)

        self._hooks = [p.register_post_accumulate_grad_hook(ready) for p in unique]

    def _bucket(self, params: list[nn.Parameter], group: ParallelGroup) -> _Bucket:
        raise NotImplementedError

    def _ready(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _add(self, params: list[nn.Parameter]) -> None:
        bucket = self._bucket(params, self.replicas.group_of(params[0]))
        self.buckets.append(bucket)
        for index, p in enumerate(params):
            self._where[id(p)] = (bucket, index)

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter, in model order."""
        return [p for bucket in reversed(self.buckets) for p in reversed(bucket.params)]

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """Arm the buckets for the backward run inside (the last of an accumulation window)."""
        for bucket in self.buckets:
            bucket.ready, bucket.pending = set(), None
        with self.window():
            yield

    def _taken(self) -> frozenset[int]:
        return frozenset(id(p) for b in self.buckets for i, p in enumerate(b.params) if i in b.ready)

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()


class GradientBuckets(HookedBuckets):
    """Overlapped, bucketed data-parallel gradient averaging for ``params`` over their replicas (see the module).

    Args:
        params: the model's parameters, in the model's order (those without ``requires_grad`` are left out).
        data: where each parameter's replicas are (:class:`Replicas`), or one group for all of them.
        overlap: start each bucket during the backward of the optimizer step's closure (``False`` under a pipeline
            schedule, whose last backward :meth:`arm_in_schedule` arms instead).
        bucket_bytes: largest bucket, in bytes of its buffer (a larger parameter gets a bucket of its own).
    """

    def __init__(self, params: Iterable[nn.Parameter], data: Union[ParallelGroup, Replicas], overlap: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self._form(params, as_replicas(data), overlap, bucket_bytes)

    def _bucket(self, params: list[nn.Parameter], group: ParallelGroup) -> _Bucket:
        return _Bucket(params, group)

    def _ready(self, param: nn.Parameter) -> None:
        if not self._acts_on(param):
            return
        bucket, index = self._where[id(param)]
        if bucket.pending is not None:
            raise RuntimeError(f"A parameter of shape {tuple(param.shape)} received a second gradient in one backward, "
                               f"after its bucket's data-parallel reduction had started (a reentrant checkpoint, or "
                               f"a backward of its own inside the step?). Use torch.utils.checkpoint with "
                               f"use_reentrant=False, and one backward per micro-batch.")
        self._fill(bucket, index, param, self._value(param))
        if len(bucket.ready) == len(bucket.params):
            bucket.pending = bucket.group.all_reduce_start(bucket.buffer.view(-1))

    @staticmethod
    def _fill(bucket: _Bucket, index: int, param: nn.Parameter, grad: Tensor) -> None:
        view = bucket.slice(index)
        view.copy_(grad)
        if param.grad is not None and param.grad.dtype == view.dtype:
            param.grad = view  # the buffer is the gradient: reduced in place
        bucket.ready.add(index)

    def finish(self) -> frozenset[int]:
        """Wait for the started buckets, average them over the group and hand 16-bit gradients their values back
        (the others are views of the buffer already). Buckets backward did not start (not armed) are filled and
        started first, if each of their parameters has a gradient. Returns the ``id`` of every parameter now averaged."""
        done: set[int] = set()
        for bucket in self.buckets:
            if bucket.pending is not None:
                continue
            if all(i in bucket.ready or p.grad is not None for i, p in enumerate(bucket.params)):
                for index, p in enumerate(bucket.params):
                    if index not in bucket.ready:
                        self._fill(bucket, index, p, p.grad)
                bucket.pending = bucket.group.all_reduce_start(bucket.buffer.view(-1))
            else:  # reduced by finalize_gradients with the parameters that have no gradient: taken values go back
                for index in bucket.ready:
                    p = bucket.params[index]
                    p.grad = bucket.slice(index).to(p.dtype, copy=True)
        for bucket in self.buckets:
            if bucket.pending is None:
                continue
            bucket.pending.wait().div_(self.replicas.divisor)
            bucket.pending = None
            for index, p in enumerate(bucket.params):
                # The slice itself where the dtypes agree; Lightning's zero_grad may have dropped .grad since the hook
                view = bucket.slice(index)
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
                done.add(id(p))
        return frozenset(done)


class NoBuckets(BucketArming):
    """Stands for :class:`GradientBuckets` where there is nothing to reduce (one data-parallel rank)."""

    overlap = False

    def arm_in_schedule(self, scale: float, earlier: Mapping[int, Tensor],
                        only: Optional[Iterable[nn.Parameter]] = None) -> bool:
        return False

    def _taken(self) -> frozenset[int]:
        return frozenset()

    @contextmanager
    def reducing(self) -> Iterator[None]:
        yield

    def finish(self) -> frozenset[int]:
        return frozenset()

    def remove(self) -> None:
        pass


Buckets = Union[GradientBuckets, NoBuckets]


def gradient_buckets(module: nn.Module, mesh: ParallelMesh, pipelined: bool) -> Buckets:
    """The buckets for ``module``'s parameters, each over its replicas of ``mesh`` (started during backward, or during
    the schedule's last backward if ``pipelined``), or :class:`NoBuckets` for one data replica. Under a
    pipeline, the parameters every stage holds a copy of are left to
    :func:`~lightning_seqpar.optim.finalize_gradients` (a stage that does not use one has no gradient for it, which
    would hold its bucket back; they are small: position embeddings, final norms)."""
    params = list(module.parameters())
    replicas = Replicas.of_mesh(mesh)
    if replicas.trivial(params):
        return NoBuckets()
    if pipelined:
        shared = set(map(id, shared_over_stages(params)))
        params = [p for p in params if id(p) not in shared]
    return GradientBuckets(params, replicas, overlap=not pipelined)
