"""``ActivationOffload``: the tensors named modules save for backward wait in host memory, as a Lightning callback."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch.nn as nn

from lightning_seqpar.memory.activations import layer_activation_bytes
from lightning_seqpar.memory.mixture import MixtureShape
from lightning_seqpar.offload import HostPool, apply_offload, check_offload_modules
from lightning_seqpar.offload.plan import OffloadPlan, plan_offload
from lightning_seqpar.recompute import micro_batch_shape, model_shape, rewritten_layers
from lightning_seqpar.transformer.core_attention import CoreAttention


class ActivationOffload(pl.Callback):
    """Offload what the named modules of every rewritten layer save for backward to host memory (Megatron-Core's
    fine-grained activation offloading, ``--offload-modules``), and bring it back when the backward reads it.

    Args:
        modules: any combination of :data:`~lightning_seqpar.offload.OFFLOAD_MODULES`: ``"attn_norm"``,
            ``"qkv_linear"``, ``"core_attn"``, ``"attn_proj"``, ``"mlp_norm"``, ``"mlp"``; or
        memory_budget: bytes of layer activations allowed on each rank at its pipeline peak: the modules are then
            :func:`~lightning_seqpar.offload.plan.plan_offload`'s choice for this rank (its layers, its schedule's
            micro-batches in flight, the recomputation in force, s and b of the first training batch; a mixture of
            experts with balanced routing, :mod:`lightning_seqpar.memory.mixture`), made at that batch; ``plan`` holds
            it. Ranks with fewer micro-batches in flight offload less.
        bytes_per_element: for ``memory_budget``: activation bytes (default: the parameters' element size).
        prefetch: bring a layer's offloaded tensors back when the backward reaches the layer after it, so the copies
            back overlap that layer's backward (default); the cost is up to one more layer's offloaded bytes on the
            device during the backward (:func:`~lightning_seqpar.plan.pricing.memory_choices.offload_backward_bytes`,
            which the planner counts; ``memory_budget`` is the activations held at the peak, before any comes back).
            ``False``: each tensor comes back when its backward node reads it.

    On CUDA the copies go to pinned memory on a side stream and come back on the compute stream after an event (no
    host synchronization); on CPU to a counted pool the memory trackers see as freed
    (:class:`~lightning_seqpar.offload.HostPool`). ``pool`` holds this rank's pool once fitting starts: its
    ``bytes_out``/``bytes_in`` are the bytes moved each way, equal to
    :func:`~lightning_seqpar.memory.activations.offloaded_activation_terms` per layer and micro-batch. Training is
    bit-identical to no offload (the same values come back). Composes with recomputation (layers checkpointed whole
    offload nothing: they keep only their input), every pipeline schedule, tensor, sequence and context parallelism.

    Raises:
        ValueError: a name not in ``OFFLOAD_MODULES``, or not exactly one of ``modules`` and a positive
            ``memory_budget`` (at construction); a budget nothing fits, or one for a mixture the memory model does not
            price (a shared expert; mixtures of different shapes on one rank) (at the first batch); when fitting
            starts (or at that batch), what :func:`~lightning_seqpar.offload.apply_offload` refuses: a module the
            layers recompute, compiled blocks (``compile=True``: the saved-tensor hooks run in Python, outside a
            graph). A ``SelectiveRecompute`` applied after this callback refuses the same conflicts.
    """

    def __init__(self, modules: Optional[list[str]] = None, memory_budget: Optional[float] = None,
                 bytes_per_element: Optional[int] = None, prefetch: bool = True) -> None:
        if (modules is None) == (memory_budget is None) or (memory_budget is not None and memory_budget <= 0):
            raise ValueError(f"ActivationOffload takes modules=[...] or a memory_budget > 0 (bytes), one of them; got "
                             f"modules={modules!r}, memory_budget={memory_budget!r}.")
        self.modules = None if modules is None else check_offload_modules(modules)
        self.memory_budget, self.bytes_per_element, self.prefetch = memory_budget, bytes_per_element, prefetch
        self.pool: Optional[HostPool] = None
        self.plan: Optional[OffloadPlan] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.memory_budget is not None and any(layer.compile_config for layer in rewritten_layers(pl_module)):
            raise ValueError("ActivationOffload(memory_budget=...) with compiled blocks (compile=True): the offload's "
                             "saved-tensor hooks run in Python, outside the compiled graph. Train with compile=False, "
                             "or recompute instead (SelectiveRecompute(modules=...)).")
        self.pool = HostPool(trainer.strategy.root_device, prefetch=self.prefetch)
        if self.modules is not None:
            apply_offload(pl_module, self.modules, self.pool)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.memory_budget is not None and self.plan is None:
            self.plan = self.choose(trainer, pl_module, *micro_batch_shape(batch))
            apply_offload(pl_module, list(self.plan.modules) or None, self.pool)  # type: ignore[arg-type]

    def choose(self, trainer: pl.Trainer, model: nn.Module, s: int, b: int) -> OffloadPlan:
        """This rank's plan for batches of ``b`` sequences of ``s`` tokens (split into the pipeline's micro-batches)."""
        from lightning_seqpar.pipeline_parallel.schedules import simulate

        assert self.memory_budget is not None
        strategy = trainer.strategy
        mesh, config = getattr(strategy, "mesh", None), getattr(getattr(strategy, "layout", None), "pipeline", None)
        p, c = (mesh.pp, mesh.cp) if mesh is not None else (1, 1)
        m, v = (config.num_microbatches, config.virtual_stages) if p > 1 and config is not None else (1, 1)
        rank = mesh.pipeline.rank if p > 1 else 0
        layers = [layer for layer in rewritten_layers(model)
                  if layer.pipeline_stage is None or layer.pipeline_stage % p == rank]
        shape, t, sp = model_shape(model, s, max(1, b // m))  # the whole sequence: the terms divide by c
        in_flight = simulate(config.schedule, m, p, v)[rank] if p > 1 else 1
        element = self.bytes_per_element or next(model.parameters()).element_size()
        experts, mixtures = _mixtures(layers, element)
        selective = any(isinstance(x, CoreAttention) and x.recompute for layer in layers for x in layer.modules())
        whole = sum(layer.checkpointed_whole for layer in layers)
        budget = self.memory_budget - in_flight * (whole / v) * layer_activation_bytes(
            shape, t, sp, "full", element, c=c)
        if whole == len(layers):  # every layer keeps only its input: nothing to offload
            return plan_offload(shape, t, sp, self.memory_budget, max(1, whole // v), in_flight, "full",
                                bytes_per_element=element, c=c)
        recomputed = [layer for layer in layers if not layer.checkpointed_whole]
        modules = (["mlp"] * any(layer.recompute_mlp and layer not in mixtures for layer in recomputed)
                   + ["moe"] * any(layer.recompute_mlp and layer in mixtures for layer in recomputed)
                   + ["moe_act"] * any("moe_act" in layer.memory.recomputed for layer in mixtures)
                   + ["layernorm"] * any(layer.recompute_norms for layer in layers))
        return plan_offload(shape, t, sp, budget, max(1, len(recomputed) // v), in_flight,
                            "selective" if selective else "none", modules, element, c=c,
                            keeps_output=p > 1 and not (rank == p - 1 and v == 1), experts=experts,
                            mixture_layers=sum(layer in mixtures for layer in recomputed) // v if experts else None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        apply_offload(pl_module, None, self.pool)  # type: ignore[arg-type]


def _mixtures(layers: list[nn.Module], element: int) -> tuple[Optional[MixtureShape], list[nn.Module]]:
    """The memory model's mixture of the layers that hold one (the same in all of them), and those layers.

    Raises:
        ValueError: mixtures of different shapes, or one with a shared expert (the memory model does not price it):
            naming the layer and the fix.
    """
    mixtures = [layer for layer in layers if layer.mlp_slot is None or layer.mlp_slot.kind != "mlp"]
    shapes = set()
    for layer in mixtures:
        slot, label = layer.mlp_slot, getattr(layer, "_name", type(layer).__name__)
        what = f"{type(layer).__name__}, which has no MLP slot" if slot is None else slot.unpriced()
        if what:
            raise ValueError(f"ActivationOffload(memory_budget=...) plans by the memory model's bytes, which do not "
                             f"price {what} ({label}): name the modules to offload instead (modules=[...]).")
        shapes.add(slot.mixture_shape(element))
    if len(shapes) > 1:
        raise ValueError(f"ActivationOffload(memory_budget=...) plans one mixture shape per rank; these layers hold "
                         f"{sorted(map(str, shapes))}: name the modules to offload instead (modules=[...]).")
    return (shapes.pop() if shapes else None), mixtures
