"""Gradient reductions that tensor, sequence and data parallelism add before the optimizer step."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from lightning_seqpar.mesh import ParallelMesh
from lightning_seqpar.tensor_parallel.collectives import ParallelGroup


def _all_reduce_coalesced(tensors: list[Tensor], group: ParallelGroup, scale: float = 1.0) -> None:
    """All-reduce ``tensors`` in place as one flat buffer per dtype (one collective instead of many)."""
    if group.size == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        group.all_reduce(flat)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def finalize_gradients(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh) -> None:
    """Make every rank's gradients those of the unparallelized model, in place.

    1. Sequence-parallel parameters (norms and row-parallel biases in the SP region, the position
       embedding) saw s/t tokens per rank: **sum** their gradients over the tensor-parallel group
       (Megatron-LM ``_allreduce_layernorm_grads``).
    2. **Average** all gradients over the data-parallel group.

    Call once per optimizer step, after the last backward of the accumulation window.
    """
    params = [p for p in parameters if p.grad is not None]
    _all_reduce_coalesced([p.grad for p in params if getattr(p, "sequence_parallel", False)], mesh.tensor)
    _all_reduce_coalesced([p.grad for p in params], mesh.data, scale=1.0 / mesh.data.size)


def _upcast(grad: Tensor) -> Tensor:
    # 16-bit squares overflow and lose precision; float32 and float64 are kept as they are.
    return grad.detach().float() if grad.element_size() < 4 else grad.detach()


def grad_norm(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh, norm_type: float = 2.0) -> Tensor:
    """The norm of the whole model's gradient, as one process would compute it.

    Each sharded parameter (``shard_spec``) contributes its shards from every tensor-parallel rank;
    each replicated parameter contributes once. Data-parallel replicas are identical after
    :func:`finalize_gradients`, so they are not counted again.

    Args:
        norm_type: 2.0 or ``inf``.

    Raises:
        ValueError: for other norm types.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"Only the 2-norm and the inf-norm are supported, got norm_type={norm_type}.")
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].grad.device
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p in grads) else torch.float32
    sharded = [_upcast(p.grad) for p in grads if hasattr(p, "shard_spec")]
    replicated = [_upcast(p.grad) for p in grads if not hasattr(p, "shard_spec")]
    if norm_type == math.inf:
        local = torch.stack([g.abs().max() for g in sharded] or [torch.zeros((), device=device)]).max()
        mesh.tensor.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        rest = torch.stack([g.abs().max() for g in replicated] or [torch.zeros((), device=device)]).max()
        return torch.maximum(local, rest)
    sharded_sq = sum((g.pow(2).sum() for g in sharded), torch.zeros((), device=device, dtype=dtype))
    mesh.tensor.all_reduce(sharded_sq)
    replicated_sq = sum((g.pow(2).sum() for g in replicated), torch.zeros((), device=device, dtype=dtype))
    return (sharded_sq + replicated_sq).sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, mesh: ParallelMesh, norm_type: float = 2.0
) -> Tensor:
    """Scale gradients in place so that :func:`grad_norm` is at most ``max_norm``; return the norm before.

    The same clipping ``torch.nn.utils.clip_grad_norm_`` applies to the unparallelized model.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
