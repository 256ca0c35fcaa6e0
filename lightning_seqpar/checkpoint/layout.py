"""How a rank's tensors are described to ``torch.distributed.checkpoint`` (DCP): global shape and offset.

DCP reshards on load when every saved and loaded tensor says which part of the global tensor it is.
A sharded parameter (and each optimizer state tensor shaped like it) becomes a ``DTensor`` view of the
live local shard over the tensor-parallel device mesh, ``[Shard(dim)]``; everything else is a plain
tensor, replicated, which DCP writes once (its deduplication picks one writer per identical piece).
Views, not copies: loading writes straight into the model's and optimizer's memory.

Two layouts of :class:`~lightning_seqpar.tensor_parallel.sharding.ShardSpec` need care:

- Vocabulary padding: rank r holds rows ``[r·c, (r+1)·c)`` of the padded table, ``c = padded/t``; the rows
  past ``full_size`` are left out, so the checkpoint holds the single-device table and the shards are
  ``torch.chunk``'s uneven split, which is DTensor's.
- Fused blocks (``chunks`` k, e.g. ``[q; k; v]``): rank r holds ``[q_r; k_r; v_r]``, k separate pieces of
  the ``[k·n, ...]`` tensor. The global tensor is stored as ``[k, n, ...]`` (a view of the same memory) and
  split along the second dim, a contiguous shard again; :func:`saved_shape` gives that shape, and the
  single-device shape is restored by a reshape (checkpoints record it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_seqpar.tensor_parallel.sharding import ShardSpec


def saved_shape(spec: Optional[ShardSpec], single_device_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape under which a tensor of ``single_device_shape`` sharded by ``spec`` is saved."""
    shape = list(single_device_shape)
    if spec is not None and spec.chunks > 1:
        shape[spec.dim:spec.dim + 1] = [spec.chunks, spec.full_size // spec.chunks]
    return tuple(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def dcp_view(local: Tensor, spec: Optional[ShardSpec], tp_mesh: Optional[DeviceMesh]) -> Tensor:
    """This rank's ``local`` tensor as DCP must see it: a plain tensor when it is replicated, otherwise a
    ``DTensor`` over ``tp_mesh`` whose global shape is :func:`saved_shape` and whose local part is a view of
    ``local`` (``[full/t, ...]``-sized; vocabulary padding cut off).

    Raises:
        ValueError: a spec whose padding is not the ``ceil(full/t)`` rows per rank DTensor's split assumes,
            or one both fused and padded.
    """
    data = local.detach()
    if spec is None:
        return data
    t = 1 if tp_mesh is None else tp_mesh.size()
    rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
    if spec.padded_size != spec.full_size:
        per_rank = spec.padded_size // t
        if spec.chunks > 1 or per_rank != -(-spec.full_size // t):
            raise ValueError(
                f"Cannot describe a shard of {spec} at t={t} to torch.distributed.checkpoint: padding must give each "
                f"rank ceil(full_size/t) rows and fused blocks cannot be padded."
            )
        keep = min(max(spec.full_size - rank * per_rank, 0), per_rank)
        data = data.narrow(spec.dim, 0, keep)  # [full/t, ...]: padding rows never reach the checkpoint
    dim = spec.dim
    if spec.chunks > 1:
        data = data.unflatten(dim, (spec.chunks, -1))  # [k, n/t, ...]: one contiguous shard of [k, n, ...]
        dim += 1
    if t == 1:
        return data
    global_shape = list(data.shape)
    global_shape[dim] = spec.full_size // spec.chunks
    shape = torch.Size(global_shape)
    return DTensor.from_local(data, tp_mesh, [Shard(dim)], run_check=False, shape=shape,
                              stride=_contiguous_stride(tuple(shape)))
