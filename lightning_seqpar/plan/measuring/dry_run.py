"""One rank of a layout built at full size on the meta device, its parameters counted against the planner's.

The model is built from its config on the meta device and its rank built by the strategy's own sequence
(:func:`lightning_seqpar.build.build_rank`) for one tensor-parallel rank of t (an emulated group: nothing communicates,
nothing is allocated; the materializer keeps every shard on the meta device): rewritten, split into pipeline stages,
its outside parts placed for ``pipeline_rank``. What the
rank then holds is counted by element and dtype, and set beside
:func:`~lightning_seqpar.plan.pricing.state.state_bytes`: the same code paths as a run, at the real size, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.state import PARAMETER_BYTES, state_bytes


@dataclass(frozen=True)
class DryRun:
    """Parameter bytes a rank holds when built (``measured``) and as the planner predicts them."""

    pipeline_rank: int
    measured: int
    predicted: int


def dry_run(config: Union[dict, str], inventory: ModelInventory, tp: int, pp: int = 1, vpp: int = 1,
            pipeline_rank: int = 0, precision: str = "bf16-mixed", tensor_rank: int = 0, ep: int = 1,
            expert_rank: int = 0, expert_tp: int = 1, schedule: str = "1F1B") -> DryRun:
    """Build the rank at ``(pipeline_rank, tensor_rank)`` of the layout (``tp``, ``pp``, ``vpp``) of the model of
    ``config`` on the meta device and count its parameter bytes (see the module docstring). A mixture of experts is
    split over ``ep`` emulated expert-parallel ranks, this one ``expert_rank``, and each expert's width over
    ``expert_tp`` more. ``schedule``: the pipeline schedule the layout runs (a record's ``schedule``), whose stage
    placement the rank is built with and predicted at (ZB-V's and DualPipeV's V: the embedding and the head both on
    pipeline rank 0).

    Raises:
        ValueError: what the rewrite, the schedule or the stage split refuses for this layout.
    """
    from lightning_seqpar.build import build_rank
    from lightning_seqpar.parallel.collectives import ParallelGroup
    from lightning_seqpar.pipeline_parallel.config import PipelineConfig
    from lightning_seqpar.pipeline_parallel.schedules import stage_placement_of
    from lightning_seqpar.plan.measuring.models import load_model_config, meta_model
    from lightning_seqpar.transformer.context import RewriteContext
    from lightning_seqpar.transformer.materialize import Materializer

    model = meta_model(load_model_config(config))
    meta = Materializer(seed=0, device=torch.device("meta"))
    pipeline = PipelineConfig.build(pp, None, schedule, vpp) if pp > 1 else PipelineConfig.build()
    width = ParallelGroup.virtual(expert_tp) if expert_tp > 1 else None
    ctx = RewriteContext(ParallelGroup.virtual(tp, tensor_rank), True, None, True, meta,
                         expert_group=ParallelGroup.virtual(ep, expert_rank) if ep > 1 else None,
                         expert_tp_group=width, expert_dispatch_group=ParallelGroup.virtual(ep * expert_tp) if width else None)
    build_rank(model, ctx, None, verify=False, pipeline=pipeline, pipeline_rank=pipeline_rank,
               expert_parallel=ep)  # the strategy's sequence, on meta
    unique = {id(p): p for p in model.parameters()}.values()
    measured = sum(p.numel() for p in unique) * PARAMETER_BYTES[precision]
    predicted = state_bytes(inventory, tp, pp, max(1, ep * expert_tp // tp), pipeline_rank=pipeline_rank,
                            vpp=pipeline.virtual_stages, precision=precision, ep=ep, expert_tp=expert_tp,
                            placement=stage_placement_of(pipeline.schedule)).parameters
    return DryRun(pipeline_rank, measured, predicted)
