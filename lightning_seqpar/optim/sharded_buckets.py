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

from typing import Optional, Union

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.optim.grad_buckets import DEFAULT_BUCKET_BYTES, HookedBuckets, Replicas, _Bucket, as_replicas
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.split_sizes import owned_range


def into_rows(flat: Tensor, region: Tensor) -> None:
    """Copy ``flat`` (``n`` elements) row by row into ``region`` ``[d, k]`` (``d·k >= n``; padding left as it is)."""
    full = flat.numel() // region.shape[1]
    region[:full].copy_(flat[: full * region.shape[1]].view(full, -1))
    if flat.numel() > full * region.shape[1]:
        region[full, : flat.numel() - full * region.shape[1]].copy_(flat[full * region.shape[1]:])


def out_of_rows(region: Tensor, flat: Tensor) -> None:
    """The inverse of :func:`into_rows`: ``flat``'s ``n`` elements from ``region``'s rows."""
    full = flat.numel() // region.shape[1]
    flat[: full * region.shape[1]].view(full, -1).copy_(region[:full])
    if flat.numel() > full * region.shape[1]:
        flat[full * region.shape[1]:].copy_(region[full, : flat.numel() - full * region.shape[1]])


class _ShardedBucket(_Bucket):
    def __init__(self, params: list[nn.Parameter], group: ParallelGroup) -> None:
        super().__init__(params, group, rows=group.size)
        self.d = group.size
        self.reduced: Optional[Tensor] = None  # [S]: this rank's ranges, summed (averaged by finish)

    def region(self, index: int, matrix: Optional[Tensor] = None) -> Tensor:
        """Parameter ``index``'s columns, ``[d, k]``, of the buffer or of another ``[d, S]`` ``matrix`` (gathered
        parameters)."""
        matrix = self.buffer if matrix is None else matrix
        return matrix[:, self.offsets[index]:self.offsets[index] + self.widths[index]]

    def put(self, index: int, grad: Optional[Tensor]) -> None:
        if grad is None:
            self.region(index).zero_()
        else:
            into_rows(grad.detach().reshape(-1), self.region(index))

    def owned(self, index: int, rank: int) -> Tensor:
        """This rank's reduced range of parameter ``index``, ``[stop - start]`` (a view of :attr:`reduced`)."""
        assert self.reduced is not None
        start, stop = owned_range(self.params[index].numel(), self.d, rank)
        return self.reduced[self.offsets[index]:self.offsets[index] + stop - start]


class ShardedGradientBuckets(HookedBuckets):
    """Bucketed reduce-scatter of ``params``' gradients over their replicas (see the module): a parameter's element
    ranges are split over the group its placement replicates it over (``dp_cp``; ``edp`` for experts).

    Args:
        params: the parameters of one optimizer, in the model's order (``requires_grad`` ones).
        data: where each parameter's replicas are (:class:`~.grad_buckets.Replicas`), or one group for all.
        overlap: start each bucket during the armed backward (not under a pipeline schedule).
        apart: parameters kept out of the others' buckets (those every pipeline stage holds, which a stage that does
            not use them gets no gradient for: they would hold a bucket back until :meth:`finish`).
        bucket_bytes: largest bucket, in bytes of its ``[d, S]`` buffer.
    """

    def __init__(self, params: list[nn.Parameter], data: Union[ParallelGroup, Replicas], overlap: bool = True,
                 apart: frozenset[int] = frozenset(), bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self._form(params, as_replicas(data), overlap, bucket_bytes, sharded=True, apart=apart)

    def _bucket(self, params: list[nn.Parameter], group: ParallelGroup) -> _ShardedBucket:
        return _ShardedBucket(params, group)

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
            bucket.pending = bucket.group.reduce_scatter_start(bucket.buffer.view(-1))

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
                bucket.pending = bucket.group.reduce_scatter_start(bucket.buffer.view(-1))
        for bucket in self.buckets:
            assert bucket.pending is not None
            bucket.reduced = bucket.pending.wait().div_(self.replicas.divisor)
            bucket.pending = None
        return [used[id(p)] for p in self.params]

    def owned_gradient(self, param: nn.Parameter) -> Tensor:
        """The averaged gradient of this rank's range of ``param`` (after :meth:`finish`), in the reduce dtype."""
        bucket, index = self._where[id(param)]
        return bucket.owned(index, bucket.group.rank)
