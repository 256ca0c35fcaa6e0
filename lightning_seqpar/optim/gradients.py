"""Gradient reductions that tensor, sequence and data parallelism add before the optimizer step."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.tensor_parallel.sharding import (
    counted_on_stage, is_pipeline_tied, is_sequence_parallel, is_stage_local, shard_spec,
)


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


def used_anywhere(flags: list[bool], host: ParallelGroup) -> list[bool]:
    """Whether each parameter got a gradient on any rank of ``host``: this rank's ``flags`` (known on the host),
    OR-ed over the group as a CPU tensor. ``host`` is a gloo group (:meth:`ParallelMesh.host`), so no device
    value is read back: the step runs ahead of the device."""
    if host.size == 1 or not flags:
        return list(flags)
    used = torch.tensor(flags, dtype=torch.uint8)
    torch.distributed.all_reduce(used, op=torch.distributed.ReduceOp.MAX, group=host.group)  # bookkeeping: not logged
    return [bool(u) for u in used.numpy()]  # host memory: read without a dispatched op


def _sum_over_stages(params: list[torch.nn.Parameter], group: ParallelGroup, host: ParallelGroup) -> None:
    """Sum gradients of parameters held by every stage of ``group`` (embeddings, final norm, head kept everywhere;
    a tied embedding and LM head in the embedding group); ``host`` is its gloo twin.

    A stage that did not use a parameter has no gradient for it; it joins with zeros, unless no stage
    used it (then it keeps ``None``, as on one device, so the optimizer skips it).
    """
    if group.size == 1 or not params:
        return
    present = [p for p, u in zip(params, used_anywhere([p.grad is not None for p in params], host)) if u]
    for p in present:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _all_reduce_coalesced([p.grad for p in present], group)


def shared_over_stages(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters every pipeline stage holds a copy of (outside the layer stack, not pipeline-tied), in the
    same order on every stage."""
    return [p for p in params if not is_stage_local(p) and not is_pipeline_tied(p)]


def finalize_gradients(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh,
                       averaged: frozenset[int] = frozenset()) -> None:
    """Make every rank's gradients those of the unparallelized model, in place.

    1. Sequence-parallel parameters (norms and row-parallel biases in the SP region, the position
       embedding) saw s/t tokens per rank: **sum** their gradients over the tensor-parallel group
       (Megatron-LM ``_allreduce_layernorm_grads``).
    2. Parameters outside the pipelined layer stack that live on every pipeline stage: each stage
       computed part of their gradient: **sum** them over the pipeline group. A tied embedding and LM head
       placed on the first and the last stage only (pipeline-tied): **sum** between those two stages
       (Megatron-LM ``_allreduce_embedding_grads`` over its embedding group).
    3. **Average** all gradients over the data-parallel group.

    Call once per optimizer step, after the last backward of the accumulation window. ``averaged``: the ``id`` of
    parameters whose gradients were averaged over the data-parallel group already, during backward
    (:class:`~lightning_seqpar.optim.grad_buckets.GradientBuckets`; the sums of steps 1-2 commute with that mean).
    """
    params = list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    _all_reduce_coalesced([p.grad for p in with_grad if is_sequence_parallel(p)], mesh.tensor)
    _sum_over_stages(shared_over_stages(params), mesh.pipeline, mesh.host("pipeline"))
    _sum_over_stages([p for p in params if is_pipeline_tied(p)], mesh.embedding, mesh.host("embedding"))
    _all_reduce_coalesced([p.grad for p in params if p.grad is not None and id(p) not in averaged], mesh.data,
                          scale=1.0 / mesh.data.size)


def _upcast(grad: Tensor) -> Tensor:
    # 16-bit squares overflow and lose precision; float32 and float64 are kept as they are.
    return grad.detach().float() if grad.element_size() < 4 else grad.detach()


def grad_norm(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh, norm_type: float = 2.0) -> Tensor:
    """The norm of the whole model's gradient, as one process would compute it.

    Each sharded parameter contributes its shards from every tensor-parallel rank;
    each stage-local parameter (:func:`lightning_seqpar.tensor_parallel.sharding.is_stage_local`) contributes from that stage,
    a pipeline-tied one from the first stage; everything else contributes once. Data-parallel replicas, and the copies of shared parameters on
    other stages, are identical after :func:`finalize_gradients`, so they are not counted again.

    Collective over the tensor and pipeline groups: every rank calls it, with or without gradients.

    Args:
        norm_type: 2.0 or ``inf``.

    Raises:
        ValueError: for other norm types.
    """
    params = list(parameters)
    return norm_of_gradients([(p, p.grad) for p in params if p.grad is not None], mesh, norm_type,
                             params[0].device if params else torch.device("cpu"))


def norm_of_gradients(gradients: list[tuple[torch.nn.Parameter, Tensor]], mesh: ParallelMesh, norm_type: float,
                      device: torch.device, data_parallel_parts: bool = False) -> Tensor:
    """:func:`grad_norm` of ``(parameter, gradient)`` pairs, each gradient counted as its parameter's tags say.
    ``data_parallel_parts``: each data-parallel rank holds a disjoint part of every gradient (the distributed
    optimizer's element ranges), so the parts are also reduced over the data-parallel group.

    Raises:
        ValueError: a norm type other than 2.0 or ``inf``.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"Only the 2-norm and the inf-norm are supported, got norm_type={norm_type}.")
    dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in gradients) else torch.float32
    inf = norm_type == math.inf
    op = torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM

    pipeline_rank = mesh.pipeline.rank
    # A pipeline-tied parameter's gradient is identical on the first and the last stage: counted on the first.
    gradients = [(p, g) for p, g in gradients if not is_pipeline_tied(p) or pipeline_rank == 0]

    def part(sharded: bool, local: bool) -> Tensor:
        chosen = [_upcast(g) for p, g in gradients
                  if (shard_spec(p) is not None) == sharded and counted_on_stage(p, pipeline_rank) == local]
        if inf:
            return torch.stack([g.abs().max().to(dtype) for g in chosen if g.numel()]
                               or [torch.zeros((), device=device, dtype=dtype)]).max()
        return sum((g.pow(2).sum().to(dtype) for g in chosen), torch.zeros((), device=device, dtype=dtype))

    combine = torch.maximum if inf else torch.add
    parts = torch.stack([part(True, True), part(True, False), part(False, True), part(False, False)])
    if data_parallel_parts:
        mesh.data.all_reduce(parts, op=op)
    sharded = parts[:2].clone()
    mesh.tensor.all_reduce(sharded, op=op)
    stage_local = mesh.pipeline.all_reduce(combine(sharded[0], parts[2]).reshape(1), op=op)[0]
    total = combine(combine(stage_local, sharded[1]), parts[3])
    return total if inf else total.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, mesh: ParallelMesh, norm_type: float = 2.0
) -> Tensor:
    """Scale gradients in place so that :func:`grad_norm` is at most ``max_norm``; return the norm before.

    The same clipping ``torch.nn.utils.clip_grad_norm_`` applies to the unparallelized model.
    """
    params = list(parameters)
    total = grad_norm(params, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in (p for p in params if p.grad is not None):
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total
