"""One rank's part of the parallel model, built in the one order every user of it follows.

1. read the pipeline placement off the single-device model (the policies recognize a model by its parts, which the
   rewrite replaces: a vocabulary-parallel embedding is no ``nn.Embedding``; the paths stay the same);
2. rewrite the recognized blocks (:func:`lightning_seqpar.policies.rewrite`), every parameter given its placement;
   their self-checks run on one rank, whose verdict every rank raises
   (:func:`~lightning_seqpar.parallel.one_rank.decided_by_one_rank`);
3. refuse a layout that splits experts over a model without any (``ep > 1``);
4. keep this rank's pipeline stage of the layer stack and the parts outside it the stage holds
   (:func:`~lightning_seqpar.pipeline_parallel.stage.split_stages`,
   :func:`~lightning_seqpar.pipeline_parallel.placement.place_outside_stack`), and give a mixture's router losses
   their carrier between stages (:func:`attach_router_losses`);
5. materialize the shards kept (meta-device blocks filled one at a time from a shared seed; on the meta device for a
   dry run).

The strategy builds its rank with :func:`build_rank` (``lightning/parallelize.py``), and so does the planner's dry run
at full size on the meta device (``plan/measuring/dry_run.py``): one sequence, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch.nn as nn

from lightning_seqpar.moe.pipeline_losses import RouterLossTerms, StageRouterLosses
from lightning_seqpar.parallel.one_rank import decided_by_one_rank
from lightning_seqpar.parallel.placement import placement_of
from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.placement import place_outside_stack
from lightning_seqpar.pipeline_parallel.stage import StageRuntime, find_layer_stack, split_stages
from lightning_seqpar.policies import pipeline_placement, plan_rewrite, rewrite
from lightning_seqpar.rewriting import Policy, RewriteContext, RewritePlan
from lightning_seqpar.transformer.materialize import Materializer
from lightning_seqpar.transformer.roles import ParallelLayer


@dataclass
class RankModel:
    """What building a rank produced, besides the model changed in place.

    Attributes:
        plan: what the rewrite did.
        runtime: the stages this rank runs (``pp > 1``), else ``None``.
        remote_keys: state-dict keys other pipeline stages hold.
    """

    plan: RewritePlan
    runtime: Optional[StageRuntime] = None
    remote_keys: list[str] = field(default_factory=list)


def build_rank(model: nn.Module, ctx: RewriteContext, policies: Optional[Iterable[Policy]], *, verify: bool,
               pipeline: PipelineConfig, pipeline_rank: int, materializer: Optional[Materializer] = None,
               expert_parallel: int = 1, checking_rank: bool = True,
               broadcast: Optional[Callable[[Any], Any]] = None) -> RankModel:
    """Build this rank's part of ``model`` in place (see the module docstring): the rank at ``ctx.group``'s
    tensor-parallel rank and ``pipeline_rank`` of ``pipeline``. ``materializer``: fills the shards kept (``None``: the
    caller's model has no meta blocks to fill, or keeps them on the meta device). ``expert_parallel``: the layout's
    ``ep``. ``verify`` with ``broadcast`` (the strategy's, of one picklable object from rank 0): the self-checks run
    on the ``checking_rank`` (rank 0) alone, the others spending no CPU on them (on one node's shared cores, every rank
    checking made each wait for all), their verdict raised on all; they are deterministic and alike on every rank
    (a small float64 copy of the model, or one block, on emulated tensor-parallel ranks), so one rank's verdict is
    every rank's. Without ``broadcast``: on this rank, which every rank then does alike.

    Raises:
        ValueError: from the rewrite (nothing recognized, shapes that do not split, a self-check's refusal),
            :func:`check_experts`, the stage split or the placement, before this rank has allocated any shard.
    """
    policies = list(policies) if policies is not None else None
    placement = pipeline_placement(model, policies) if pipeline.enabled else {}
    if verify and broadcast is not None:
        decided_by_one_rank(lambda: plan_rewrite(model, ctx, policies, verify=True) and None, checking_rank, broadcast)
        verify = False  # checked; the rewrite below repeats only the static checks, alike on every rank
    plan = rewrite(model, ctx, policies, verify)
    check_experts(model, expert_parallel, ctx.expert_tp)
    built = RankModel(plan)
    if pipeline.enabled:  # embeddings on the first stage, final norm and head on the last, where a policy says so
        moe_layers = moe_layer_indices(model)
        built.runtime, built.remote_keys = split_stages(model, pipeline, pipeline_rank)
        carrier = attach_router_losses(model, built.runtime, moe_layers)
        if carrier is not None:
            built.runtime.payload = carrier
        built.remote_keys += place_outside_stack(model, placement, built.runtime, pipeline_rank)
    if materializer is not None:
        materializer.fill(model, ctx.shard_group, ctx.inner_shard_group)
    return built


def check_experts(model: nn.Module, expert_parallel: int, expert_tp: int = 1) -> None:
    """A layout that splits experts (``ep > 1``, or their widths: ``expert_tp > 1``) has a model with experts: a
    parameter placed over ``ep``.

    Raises:
        ValueError: ``ep > 1`` or ``expert_tp > 1`` and no expert parameter after the rewrite (every rank decides
            alike: no hang).
    """
    if expert_parallel == 1 and expert_tp == 1:
        return
    if not any(placement_of(p).shard_over == "ep" and placement_of(p).shard is not None for p in model.parameters()):
        split = f"ep={expert_parallel}" if expert_parallel > 1 else f"expert_tp={expert_tp}"
        raise ValueError(f"{split} splits experts over ranks, and this model has none after the rewrite "
                         f"(no mixture-of-experts layer was recognized): leave ep=1 and expert_tp=1.")


def attach_router_losses(model: nn.Module, runtime: StageRuntime,
                         moe_layers: set[int]) -> Optional[StageRouterLosses]:
    """Under pipeline parallelism, give this rank's mixture-of-experts parts a
    :class:`~lightning_seqpar.moe.pipeline_losses.StageRouterLosses` when the model adds router losses to its loss
    (``output_router_logits``), and the module holding that config a forward pre-hook reading its
    ``attention_mask``; ``None`` (nothing attached) otherwise.

    Args:
        model: this rank's split model (:func:`~lightning_seqpar.pipeline_parallel.split_stages`).
        runtime: its :class:`~lightning_seqpar.pipeline_parallel.StageRuntime`.
        moe_layers: the indices in the layer stack of every layer with a mixture of experts (before the split).

    Raises:
        ValueError: the last stage holds no mixture-of-experts layer (its loss would not read the router statistics),
            naming the fix; every rank decides alike.
    """
    owner = next((m for m in model.modules() if RouterLossTerms.of(getattr(m, "config", None)) is not None), None)
    if owner is None or not moe_layers:
        return None
    terms = RouterLossTerms.of(owner.config)
    assert terms is not None
    last = runtime.layout.num_stages - 1
    start, end = runtime.layout.bounds(last)
    if not moe_layers & set(range(start, end)):
        raise ValueError(f"The last pipeline stage holds layers {start}..{end - 1}, none with a mixture of experts, and "
                         f"the model adds its router losses (output_router_logits=True) in the loss there. Place at "
                         f"least one mixture-of-experts layer on the last stage (pipeline.layers_per_stage), or set "
                         f"output_router_logits=False.")
    parts: dict[int, list[Any]] = {}
    for layer in (m for m in model.modules() if isinstance(m, ParallelLayer)):
        slot = layer.mlp_slot
        if layer.pipeline_stage is not None and slot is not None and slot.kind == "moe":
            parts.setdefault(layer.pipeline_stage, []).append(slot)
    carrier = StageRouterLosses(terms, parts, last)
    for part in (p for found in parts.values() for p in found):
        part.tokens = dataclasses.replace(part.tokens, stages=carrier)
    owner.register_forward_pre_hook(carrier.capture, with_kwargs=True)
    return carrier


def moe_layer_indices(model: nn.Module) -> set[int]:
    """The indices in the layer stack of the rewritten layers whose MLP is a mixture of experts."""
    container, indices = find_layer_stack(model)
    return {i for i in indices if container[i].mlp_slot is not None and container[i].mlp_slot.kind == "moe"}
