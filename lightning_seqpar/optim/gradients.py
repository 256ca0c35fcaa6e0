"""Gradient reductions that tensor, sequence, pipeline and data parallelism add before the optimizer step.

Which groups a parameter's gradient is reduced over is its placement's to say
(:class:`~lightning_seqpar.parallel.placement.Placement`); everything here iterates by group name, in the fixed order
of :data:`~lightning_seqpar.parallel.dims.GROUPS`, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.dims import GROUPS
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import (
    REPLICA_GROUPS, SHARD_GROUPS, is_pipeline_tied, is_stage_local, placement_of,
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


def by_group(params: Iterable[torch.nn.Parameter], field: str) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """``params`` grouped by the group their placement names in ``field`` (``"replicated_over"``, ``"stage_group"``,
    ``"partial_over"``: a parameter under each name it lists; none: left out), in the fixed order of
    :data:`~lightning_seqpar.parallel.dims.GROUPS` then ``"embedding"``."""
    chosen: dict[str, list[torch.nn.Parameter]] = {}
    for p in params:
        value = getattr(placement_of(p), field)
        for name in (value if isinstance(value, tuple) else () if value is None else (value,)):
            chosen.setdefault(name, []).append(p)
    return [(name, chosen[name]) for name in (*GROUPS, "embedding") if name in chosen]


def finalize_gradients(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh,
                       averaged: frozenset[int] = frozenset()) -> None:
    """Make every rank's gradients those of the unparallelized model, in place, as each parameter's placement says.

    1. Partial gradients (``partial_over``: sequence-parallel norms and row-parallel biases in the SP region, the
       position embedding, saw s/t tokens per rank): **sum** over each named group (Megatron-LM
       ``_allreduce_layernorm_grads``).
    2. Parameters outside the pipelined layer stack that live on every pipeline stage: each stage
       computed part of their gradient: **sum** them over the pipeline group. A tied embedding and LM head
       placed on the first and the last stage only (pipeline-tied): **sum** between those two stages
       (Megatron-LM ``_allreduce_embedding_grads`` over its embedding group).
    3. **Sum** over the data replicas (``replicated_over``: ``dp_cp``, or ``edp`` for experts) and divide by the
       number of data replicas d·c.

    Call once per optimizer step, after the last backward of the accumulation window. ``averaged``: the ``id`` of
    parameters reduced over their replicas already, during backward
    (:class:`~lightning_seqpar.optim.grad_buckets.GradientBuckets`; the sums of steps 1-2 commute with that mean).
    """
    params = list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    for name, chosen in by_group(with_grad, "partial_over"):
        _all_reduce_coalesced([p.grad for p in chosen], mesh.group(name))
    for name, chosen in by_group(params, "stage_group"):
        _sum_over_stages(chosen, mesh.group(name), mesh.host(name))
    pending = [p for p in params if p.grad is not None and id(p) not in averaged]
    for name, chosen in by_group(pending, "replicated_over"):
        _all_reduce_coalesced([p.grad for p in chosen], mesh.group(name), scale=1.0 / mesh.replicas)


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
    """:func:`grad_norm` of ``(parameter, gradient)`` pairs, each gradient counted as its parameter's placement says
    (:meth:`~lightning_seqpar.parallel.placement.Placement.norm_groups`). ``data_parallel_parts``: each replica holds
    a disjoint part of every gradient (the distributed optimizer's element ranges), so the parts are also reduced
    over each parameter's replicas.

    The partial sums are kept per set of groups to reduce over (every subset of :func:`_norm_groups`, the same on every
    rank); each group then reduces, in one collective, the sums whose set holds it.

    Raises:
        ValueError: a norm type other than 2.0 or ``inf``.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"Only the 2-norm and the inf-norm are supported, got norm_type={norm_type}.")
    dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in gradients) else torch.float32
    inf = norm_type == math.inf
    op = torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM
    names = _norm_groups(mesh, data_parallel_parts)
    keys = [tuple(n for i, n in enumerate(names) if mask >> i & 1) for mask in range(2 ** len(names))]
    index = {key: i for i, key in enumerate(keys)}
    chosen: list[list[Tensor]] = [[] for _ in keys]
    pipeline_rank = mesh.pipeline.rank
    for p, g in gradients:
        placement = placement_of(p)
        if not placement.counted_on(pipeline_rank):
            continue  # a pipeline-tied gradient is identical on the first and the last stage: counted on the first
        over = {mesh.representative(n) for n in placement.norm_groups(pipeline_rank, data_parallel_parts)}
        chosen[index[tuple(n for n in names if n in over)]].append(_upcast(g))

    def part(grads: list[Tensor]) -> Tensor:
        if inf:
            return torch.stack([g.abs().max().to(dtype) for g in grads if g.numel()]
                               or [torch.zeros((), device=device, dtype=dtype)]).max()
        return sum((g.pow(2).sum().to(dtype) for g in grads), torch.zeros((), device=device, dtype=dtype))

    parts = torch.stack([part(grads) for grads in chosen])
    for name in names:
        holding = [k for k, key in enumerate(keys) if name in key]
        reduced = mesh.group(name).all_reduce(parts[holding].clone(), op=op)
        parts[holding] = reduced
    total = parts.max() if inf else parts.sum()
    return total if inf else total.sqrt()


def _norm_groups(mesh: ParallelMesh, data_parallel_parts: bool) -> list[str]:
    """The groups a norm's partial sums are reduced over, one name per distinct set of ranks of more than one
    (:meth:`~lightning_seqpar.parallel.mesh.ParallelMesh.representative`), the same on every rank: those a parameter
    can be split over and ``pp``, and the replica groups when each replica holds a part of every gradient."""
    candidates = (*SHARD_GROUPS, "pp", *(REPLICA_GROUPS if data_parallel_parts else ()))
    chosen = {mesh.representative(name) for name in candidates} - {None}
    return [name for name in GROUPS if name in chosen]


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
