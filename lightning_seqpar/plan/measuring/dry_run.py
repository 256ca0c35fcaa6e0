"""One rank of a layout built at full size on the meta device, its parameters counted against the planner's.

The model is built from its config on the meta device and its rank built by the strategy's own sequence
(:func:`lightning_seqpar.build.build_rank`) for one rank of the layout (a virtual mesh: nothing communicates,
nothing is allocated; the materializer keeps every shard on the meta device): rewritten, split into pipeline stages,
its outside parts placed for ``pipeline_rank``. What the
rank then holds is counted by element and dtype, and set beside
:func:`~lightning_seqpar.plan.pricing.state.state_bytes`: the same code paths as a run, at the real size, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Union

import torch

from lightning_seqpar.layout import Layout
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.state import PARAMETER_BYTES, state_bytes


@dataclass(frozen=True)
class DryRun:
    """Parameter bytes a rank holds when built (``measured``) and as the planner predicts them."""

    pipeline_rank: int
    measured: int
    predicted: int


def dry_run(config: Union[dict, str], inventory: ModelInventory, layout: Layout, pipeline_rank: int = 0,
            precision: str = "bf16-mixed", tensor_rank: int = 0, expert_rank: int = 0) -> DryRun:
    """Build the rank at ``(pipeline_rank, tensor_rank, expert_rank)`` of ``layout`` (a record's
    :class:`~lightning_seqpar.Layout`: its sizes, and its schedule's stage placement, ZB-V's and DualPipeV's V with
    the embedding and the head both on pipeline rank 0) of the model of ``config`` on the meta device, through the
    strategy's own context (:meth:`~lightning_seqpar.transformer.context.RewriteContext.of` over a virtual mesh) and
    build sequence, and count its parameter bytes (see the module docstring). A mixture of experts is split over the
    layout's ``ep`` expert-parallel ranks and each expert's width over its ``expert_tp``.

    Raises:
        ValueError: what the rewrite, the schedule or the stage split refuses for this layout; a coordinate outside
            it.
    """
    from lightning_seqpar.build import build_rank
    from lightning_seqpar.parallel.mesh import ParallelMesh
    from lightning_seqpar.pipeline_parallel.schedules import stage_placement_of
    from lightning_seqpar.plan.measuring.models import load_model_config, meta_model
    from lightning_seqpar.transformer.context import RewriteContext
    from lightning_seqpar.transformer.materialize import Materializer

    model = meta_model(load_model_config(config))
    meta = Materializer(seed=0, device=torch.device("meta"))
    tp, pp, ep, expert_tp = layout.tp, layout.pp, layout.ep, layout.expert_tp
    dims = layout.dims(tp * layout.cp * pp * ep * expert_tp)  # the smallest world the experts fold into
    wanted = (pipeline_rank, tensor_rank, expert_rank)
    mesh = next((m for m in map(partial(ParallelMesh.virtual, dims), range(dims.world_size))
                 if (m.pipeline.rank, m.tensor.rank, m.group("ep").rank) == wanted), None)
    if mesh is None:
        raise ValueError(f"(pipeline, tensor, expert) rank {wanted} is not a rank of {layout}.")
    pipeline = layout.pipeline
    build_rank(model, RewriteContext.of(layout, mesh, materialize=meta), None, verify=False, pipeline=pipeline,
               pipeline_rank=pipeline_rank, expert_parallel=ep)  # the strategy's sequence, on meta
    unique = {id(p): p for p in model.parameters()}.values()
    measured = sum(p.numel() for p in unique) * PARAMETER_BYTES[precision]
    predicted = state_bytes(inventory, tp, pp, max(1, ep * expert_tp // tp), pipeline_rank=pipeline_rank,
                            vpp=pipeline.virtual_stages, precision=precision, ep=ep, expert_tp=expert_tp,
                            placement=stage_placement_of(pipeline.schedule)).parameters
    return DryRun(pipeline_rank, measured, predicted)
