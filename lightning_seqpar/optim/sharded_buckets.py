"""Gradient buckets reduce-scattered over the data-parallel group: each rank keeps the sum of its element ranges.

The gradient side of the distributed optimizer (:mod:`.distributed_optimizer`). Every parameter's ``n`` elements
(its tensor-parallel shard, flattened) are split into d ranges of ``k = ceil(n / d)``; data-parallel rank r owns
elements ``[r·k, min((r+1)·k, n))``. A bucket's buffer is ``[d, S]`` with ``S`` the sum of its parameters' ``k``:
row r holds, side by side, the r-th range of each of them (zero padding past ``n``), so one
``reduce_scatter_tensor`` leaves rank r with the sums of exactly its ranges, ``[S]``. Moving ``d·S`` elements per
bucket, it is the first half of an all-reduce (Megatron-LM's ``DistributedOptimizer`` over its grad buffers).

Buckets are formed and started as in :class:`~.grad_buckets.GradientBuckets` (reverse model order, at most
``bucket_bytes``, started when the last gradient arrives during the armed backward). Once a gradient is copied
into its bucket, ``param.grad`` is dropped: the buffers hold the only copy. Buckets not started during backward
(under a pipeline schedule, whose backward passes run inside the training step; or a parameter without a gradient)
are filled and started by :meth:`ShardedGradientBuckets.finish`. Gradients are reduced in float32 where they are
16-bit.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.optim.grad_buckets import DEFAULT_BUCKET_BYTES, BucketArming
from lightning_seqpar.parallel.collectives import ParallelGroup, Pending


def owned_range(numel: int, d: int, rank: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of a flattened tensor of ``numel`` elements that data-parallel ``rank`` of ``d``
    owns (``ceil(numel / d)`` each, the last ranges shorter or empty)."""
    k = -(-numel // d)
    return min(rank * k, numel), min((rank + 1) * k, numel)


def _rows(flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``flat`` (``n`` elements) as its full rows of ``k``, ``[n // k, k]``, and the shorter rest ``[n % k]``."""
    full = flat.numel() // k
    return flat[: full * k].view(full, k), flat[full * k:]


class _ShardedBucket:
    def __init__(self, params: list[nn.Parameter], data: ParallelGroup) -> None:
        self.params, self.d = params, data.size
        dtype = params[0].dtype
        self.reduce_dtype = torch.float32 if dtype.itemsize < 4 else dtype
        self.widths = [-(-p.numel() // self.d) for p in params]
        self.columns, total = [], 0
        for k in self.widths:
            self.columns.append(total)
            total += k
        self.width = total  # S
        self.buffer = torch.zeros(self.d, total, dtype=self.reduce_dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.pending: Optional[Pending] = None
        self.reduced: Optional[Tensor] = None  # [S]: this rank's ranges, summed (averaged by finish)

    def region(self, index: int) -> Tensor:
        """Parameter ``index``'s columns of the buffer, ``[d, k]``."""
        return self.buffer[:, self.columns[index]:self.columns[index] + self.widths[index]]

    def put(self, index: int, grad: Optional[Tensor]) -> None:
        region, k = self.region(index), self.widths[index]
        if grad is None:
            region.zero_()
            return
        full, rest = _rows(grad.detach().reshape(-1), k)
        region[: full.shape[0]].copy_(full)
        if rest.numel():
            region[full.shape[0], : rest.numel()].copy_(rest)

    def owned(self, index: int, rank: int) -> Tensor:
        """This rank's reduced range of parameter ``index``, ``[stop - start]`` (a view of :attr:`reduced`)."""
        assert self.reduced is not None
        start, stop = owned_range(self.params[index].numel(), self.d, rank)
        return self.reduced[self.columns[index]:self.columns[index] + stop - start]


class ShardedGradientBuckets(BucketArming):
    """Bucketed reduce-scatter of ``params``' gradients over ``data`` (see the module).

    Args:
        params: the parameters of one optimizer, in the model's order (``requires_grad`` ones).
        data: the data-parallel group.
        overlap: start each bucket during the armed backward (not under a pipeline schedule).
        apart: parameters kept out of the others' buckets (those every pipeline stage holds, which a stage that does
            not use them gets no gradient for: they would hold a bucket back until :meth:`finish`).
        bucket_bytes: largest bucket, in bytes of its ``[d, S]`` buffer.
    """

    def __init__(self, params: list[nn.Parameter], data: ParallelGroup, overlap: bool = True,
                 apart: frozenset[int] = frozenset(), bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.data, self.overlap = data, overlap
        self.buckets: list[_ShardedBucket] = []
        self._where: dict[int, tuple[_ShardedBucket, int]] = {}
        group: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            nbytes = -(-p.numel() // data.size) * data.size * max(4, p.element_size())
            if group and (size + nbytes > bucket_bytes or p.dtype != group[0].dtype or p.device != group[0].device
                          or (id(p) in apart) != (id(group[0]) in apart)):
                self._add(group)
                group, size = [], 0
            group.append(p)
            size += nbytes
        if group:
            self._add(group)
        this = weakref.ref(self)  # the hooks must not keep a replaced optimizer's buffers alive (a second fit)

        def ready(param: nn.Parameter) -> None:
            buckets = this()
            if buckets is not None:
                buckets._ready(param)

        self._hooks = [p.register_post_accumulate_grad_hook(ready) for p in params]

    def _add(self, params: list[nn.Parameter]) -> None:
        bucket = _ShardedBucket(params, self.data)
        self.buckets.append(bucket)
        for index, p in enumerate(params):
            self._where[id(p)] = (bucket, index)

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """Arm the buckets for the backward run inside (the last of an accumulation window)."""
        for bucket in self.buckets:
            bucket.ready, bucket.pending, bucket.reduced = set(), None, None
        with self.window():
            yield

    def _taken(self) -> frozenset[int]:
        return frozenset(id(p) for b in self.buckets for i, p in enumerate(b.params) if i in b.ready)

    def _ready(self, param: nn.Parameter) -> None:
        if not self._acts_on(param):
            return
        bucket, index = self._where[id(param)]
        if index in bucket.ready:
            raise RuntimeError(f"A parameter of shape {tuple(param.shape)} received a second gradient in one backward, "
                               f"after it was handed to its data-parallel reduction (a reentrant checkpoint, or a "
                               f"backward of its own inside the step?). Use torch.utils.checkpoint with "
                               f"use_reentrant=False, and one backward per micro-batch.")
        bucket.put(index, self._value(param))
        param.grad = None  # the bucket holds it now
        bucket.ready.add(index)
        if len(bucket.ready) == len(bucket.params):
            bucket.pending = self.data.reduce_scatter_start(bucket.buffer.view(-1))

    def finish(self) -> list[bool]:
        """Fill and start the buckets backward did not, wait for all, average over the group. Returns, per
        parameter in :attr:`params` order, whether it got a gradient on this rank."""
        used: dict[int, bool] = {}
        for bucket in self.buckets:
            for index, p in enumerate(bucket.params):
                used[id(p)] = index in bucket.ready or p.grad is not None
                if index not in bucket.ready:
                    bucket.put(index, p.grad)
                    p.grad = None
            if bucket.pending is None:
                bucket.pending = self.data.reduce_scatter_start(bucket.buffer.view(-1))
        for bucket in self.buckets:
            assert bucket.pending is not None
            bucket.reduced = bucket.pending.wait().div_(self.data.size)
            bucket.pending = None
        return [used[id(p)] for p in self.params]

    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter, in model order."""
        return [p for bucket in reversed(self.buckets) for p in reversed(bucket.params)]

    def owned_gradient(self, param: nn.Parameter) -> Tensor:
        """The averaged gradient of this rank's range of ``param`` (after :meth:`finish`), in the reduce dtype."""
        bucket, index = self._where[id(param)]
        return bucket.owned(index, self.data.rank)

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
