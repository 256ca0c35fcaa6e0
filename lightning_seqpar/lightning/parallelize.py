"""From the user's single-device model to this rank's part of the parallel one, in the order it must happen:
same weights everywhere → dropout streams → the rank built (:func:`lightning_seqpar.build.build_rank`: rewrite →
pipeline split → materialize the shards kept) → the pipeline's steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from lightning_seqpar.hf.init import hf_initializers
from lightning_seqpar.transformer.lora import lora_initializers
from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps
from lightning_seqpar.layout import Layout
from lightning_seqpar.lightning.config import RewriteConfig
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.build import build_rank
from lightning_seqpar.rewriting import RewriteContext, RewritePlan
from lightning_seqpar.transformer.compiling import compile_blocks
from lightning_seqpar.transformer.materialize import Materializer


@dataclass
class ParallelModel:
    """What parallelizing a model produced, besides the model rewritten in place."""

    rng_tracker: RNGTracker
    rewrite_plan: RewritePlan
    pipeline: Optional[PipelinedSteps]
    """the pipelined steps when ``pp > 1``"""
    remote_keys: list[str]
    """state-dict keys held by other pipeline stages"""


def broadcast_module(module: torch.nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers, so an unseeded init cannot diverge.

    One tensor at a time, in place; with NCCL a host tensor goes through a device buffer of its size, so
    the unsliced model is never on the device. Tensors on the meta device (built in ``configure_model``) are
    skipped: they are materialized from a shared seed instead.
    """
    if dist.get_world_size() == 1:
        return
    staged = dist.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_meta:
                continue
            if staged and tensor.device != device:
                buffer = tensor.data.to(device)
                dist.broadcast(buffer, src=0)
                tensor.data.copy_(buffer)
            else:
                dist.broadcast(tensor.data, src=0)


def seed_streams(seed: int, mesh: ParallelMesh, device: torch.device) -> RNGTracker:
    """Seed the default generator alike over the tensor-parallel group (replicated regions) and return the
    tracker of the per-rank tensor-parallel stream (sharded regions); pipeline stages draw apart, and so do
    context-parallel ranks (they hold other tokens in every region)."""
    pp_rank, tp_rank = mesh.pipeline.rank, mesh.tensor.rank
    base = seed + 100 * pp_rank + 7919 * mesh.context.rank
    torch.manual_seed(base)
    return RNGTracker.for_tensor_parallel(base, tp_rank, device)


def parallelize(model: torch.nn.Module, mesh: ParallelMesh, device: torch.device, layout: Layout, *,
                seed: Optional[int], broadcast: Callable[[Any], Any], rewriting: RewriteConfig,
                source: Optional[Mapping[str, Any]] = None) -> ParallelModel:
    """Rewrite ``model`` (a LightningModule, in place) into this rank's tensor (+ sequence) and pipeline parallel
    part, as ``layout`` says (sequence and loss parallelism, the pipeline, the context-parallel attention when the
    mesh has ``cp > 1``, the loss's chunk of positions: :class:`~lightning_seqpar.rewriting.RewriteContext`).
    ``seed``: base seed of the dropout streams and of meta-device materialization; ``None`` takes rank 0's
    ``torch.initial_seed()`` through ``broadcast``. ``rewriting``: the user's policies; whether to run the policies'
    self-checks (on rank 0; every rank raises its verdict: :func:`~lightning_seqpar.build.build_rank`); compiled
    blocks (every rewritten block's body through ``torch.compile``,
    :func:`~lightning_seqpar.transformer.compiling.compile_blocks`). ``source``: single-device weights read
    straight into the shards of a model built on the meta device (checked already); what it lacks is drawn with
    the owning model's initializer (Hugging Face's, found in the model) or the policy's.

    Raises:
        ValueError: from the rewrite (nothing recognized, shapes that do not split) or the pipeline split, before
            any rank has changed its model; a block ``compiled`` cannot take (every rank refuses alike).
    """
    # The single-device model stays where it was built; only its shards move to the device afterwards.
    broadcast_module(model, device)
    seed = seed if seed is not None else broadcast(torch.initial_seed() % 2**31)
    rng_tracker = seed_streams(seed, mesh, device)
    # Blocks built on the meta device (configure_model) become meta skeletons; after the stage split the shards
    # this rank keeps are allocated and filled from single-device submodules materialized one at a time from a
    # seed shared by every rank. Other stages' layers are never materialized.
    materializer = Materializer(seed, initializers=hf_initializers(model) + lora_initializers(model), source=source)
    ctx = RewriteContext.of(layout, mesh, rng_tracker, materializer)
    rank = build_rank(model, ctx, rewriting.policies, verify=rewriting.verify, pipeline=layout.pipeline,
                      pipeline_rank=mesh.pipeline.rank,
                      materializer=materializer, expert_parallel=mesh.dims.ep if mesh.dims is not None else 1,
                      checking_rank=dist.get_rank() == 0, broadcast=broadcast)
    if rewriting.compile is not None:  # each block compiles at its first call, after the recomputation callbacks apply
        compile_blocks(model, rewriting.compile)
    steps = PipelinedSteps.of(rank.runtime, layout.pipeline, mesh.pipeline, device, model) \
        if rank.runtime is not None else None
    return ParallelModel(rng_tracker, rank.plan, steps, rank.remote_keys)


def check_before_start(strategy: Any, module: Any, trainer: Any = None, rank_zero: bool = False) -> None:
    """The layout's static checks of ``module`` at ``strategy``'s sizes, run in the launching process before any rank
    starts, so that a layout that cannot work fails once, at once, with exit 1: the rewrite's (heads, MLP width and
    vocabulary against tp; experts against ep and expert_tp; what is recognized), the pipeline's stage split of the
    layers (``pipeline_split``, virtual stages, ZB-V's two chunks per rank), ``compile`` against a dropless mixture of
    experts, and the recomputation and offload callbacks against each other. A module that builds its model in
    ``configure_model`` is checked on its model built on the meta device as every rank builds it, the module left as
    it was (:func:`~lightning_seqpar.lightning.declared_model.model_for_checks`); one that builds it in ``setup`` is
    checked by the ranks. The self-check (a
    forward on emulated ranks) runs on the ranks only. With ``rank_zero``, a ``layout=AutoLayout(...)`` is chosen
    here too, so a budget no layout fits is refused once, before the other ranks start.

    Raises:
        ValueError: as :func:`~lightning_seqpar.policies.plan_rewrite`; a pipeline stage split the layers found do not
            admit (:meth:`~lightning_seqpar.pipeline_parallel.config.PipelineConfig.layout`); ``compile`` with a
            dropless mixture; a module both recomputed and offloaded by the callbacks.
    """
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_seqpar.lightning.declared_model import model_for_checks
    from lightning_seqpar.policies import plan_rewrite

    if rank_zero and trainer is not None:  # layout=AutoLayout: chosen here, once
        strategy.choose_layout(module, trainer)
    layout = strategy.layout
    if trainer is not None:
        check_memory_callbacks(trainer.callbacks, layout.cp)
    if not isinstance(module, torch.nn.Module) or is_overridden("setup", module):
        return
    module = model_for_checks(module, strategy.model_sharded_context)
    if module is None:  # its configure_model needs what only a rank has: the ranks check it
        return
    world = strategy.num_nodes * strategy.num_processes  # split by the layout already (check_world)
    ctx = RewriteContext.of(layout, ParallelMesh.virtual(layout.dims(world)))  # rank 0's, as every rank rewrites
    plan_rewrite(module, ctx, strategy.rewriting.policies, verify=False)
    if strategy.rewriting.compile is not None and layout.moe.capacity_factor is None and _holds_mixture(module):
        raise ValueError("compile=True: the model holds a dropless mixture of experts, which is not compiled (its "
                         "dispatch reads the split sizes on the host: a graph break): give the experts a capacity "
                         "(Layout(moe=DispatchConfig(capacity_factor=...)): fixed sizes, no host read), or train "
                         "with RewriteConfig(compile=False).")
    if layout.pipeline.enabled:  # the stage split of the layer stack (pipeline_split's sum, p·v ≤ L)
        stacks = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
                  and len({type(layer) for layer in m}) == 1]
        if stacks:  # the largest list of alike modules: the layers (the ranks check the rewritten stack itself)
            layers = max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))
            layout.pipeline.layout(len(layers))


def _holds_mixture(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a mixture of experts' packed weights (``…experts.gate_up_proj`` ``[E, …]``: the
    reference GPT's and transformers 5.x's layout)."""
    return any(".experts." in name and param.dim() == 3 for name, param in module.named_parameters())


def check_memory_callbacks(callbacks: Iterable[Any], cp: int) -> None:
    """Refuse a module that a ``SelectiveRecompute(modules=...)`` recomputes and an ``ActivationOffload`` offloads, from
    the callbacks' own lists (what each layer checks again when its policy is set, core attention included,
    :meth:`~lightning_seqpar.transformer.roles.ParallelLayer.memory_refusal`), before any rank starts.

    Raises:
        ValueError: naming the modules and the fix (:class:`~lightning_seqpar.memory.conflicts.OffloadConflict`).
    """
    from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
    from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute
    from lightning_seqpar.memory.conflicts import offload_conflict, recomputed_modules

    recompute = next((c for c in callbacks if isinstance(c, SelectiveRecompute)), None)
    offload = next((c for c in callbacks if isinstance(c, ActivationOffload)), None)
    if recompute is None or offload is None or offload.modules is None:
        return
    # Core attention is left to the layers: whether it is recomputed depends on the kernel (an eager attention has an
    # s² tensor to recompute, a fused one none), which only the rewritten layer knows.
    modules = [m for m in recompute.modules or [] if m != "core_attn"]
    conflict = offload_conflict(offload.modules, recomputed_modules("none", modules, cp))
    if conflict is not None:
        raise ValueError(f"SelectiveRecompute and ActivationOffload: {conflict.message(offload.modules)}")
