"""Which modules of the rewritten layers offload what they save for backward (Megatron-Core's ``--offload-modules``).

A module offloads *the tensors autograd saves while it runs*: for a norm, its input (and statistics); for a linear,
its input; for core attention, q, k, v and what softmax and dropout keep. Parameters and buffers stay where they are.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.memory.conflicts import EXPERT_MODULES, OFFLOAD_MODULES, offload_conflict
from lightning_seqpar.offload.host_pool import HostPool
from lightning_seqpar.recompute.apply import module_names
from lightning_seqpar.transformer.masks import FutureMask
from lightning_seqpar.memory.saved_tensors import Packer

def check_offload_modules(modules: Any) -> list[str]:
    """``modules`` (a name or names) as a list, checked: names of :data:`OFFLOAD_MODULES`
    (:func:`~lightning_seqpar.recompute.apply.module_names`; raises its ``ValueError``)."""
    return module_names(modules, OFFLOAD_MODULES)


class LayerOffload:
    """What one rewritten layer offloads, and to which pool (a :class:`HostPool` shared by the rank's layers)."""

    def __init__(self, names: list[str], pool: HostPool, order: Optional[dict[int, int]] = None) -> None:
        self.names, self.pool = frozenset(names), pool
        self.order = order or {}  # id(layer) -> its place among the model's layers (what links prefetches)

    def packer(self, layer: nn.Module, module: str, shared: tuple[Optional[Tensor], ...] = ()) -> Optional[Packer]:
        """The offloading packer for ``module`` of ``layer`` (``None`` when it is not named). What is not one forward's
        activation stays: parameters, buffers, the cached causal masks and ``shared`` (tensors every layer reads: the
        model's attention mask, its rotary cos/sin), which would otherwise be copied once per layer and freed by
        none."""
        if module not in self.names:
            return None
        held = [*layer.parameters(), *layer.buffers(), *shared]
        held += [m.future_mask.cached() for m in layer.modules() if isinstance(getattr(m, "future_mask", None),
                                                                              FutureMask)]
        index = self.order.get(id(layer))
        # (the experts' regions are entered once per expert in the loop over experts: one layer forward still)
        forward = self.pool.layer_forward(index, module, module in EXPERT_MODULES) if index is not None else None
        return self.pool.packer({t.untyped_storage().data_ptr() for t in held if t is not None}, forward)


def apply_offload(model: nn.Module, modules: Any, pool: HostPool) -> int:
    """Offload the named modules' saved tensors in every rewritten layer of ``model`` to ``pool``; return the number of
    layers set. ``modules=None`` undoes it. Layers checkpointed whole (full recomputation) keep only their input and
    offload nothing.

    Raises:
        ValueError: see :func:`check_offload_modules`; a rewritten layer that is not a
            :class:`~lightning_seqpar.transformer.declared_block.ParallelBlock`, or one whose MLP is a mixture of
            experts when ``"mlp"`` is named (by name, with the fix); no rewritten layer.
    """
    from lightning_seqpar.recompute.apply import rewritten_layers
    from lightning_seqpar.transformer.declared_block import ParallelBlock

    layers = rewritten_layers(model)
    if modules is None:
        for layer in layers:
            layer.offload = None
            if layer.mlp_slot is not None:
                layer.mlp_slot.offload_within(None)
        return 0
    names = check_offload_modules(modules)
    if not layers:
        raise ValueError("Activation offload found no rewritten transformer layer in the model: is it rewritten?")
    for layer in layers:
        label = getattr(layer, "_name", type(layer).__name__)
        if not isinstance(layer, ParallelBlock):
            raise ValueError(f"Activation offload runs in the parallel blocks built from a BlockSpec; {label} is a "
                             f"{type(layer).__name__}: leave ActivationOffload out for this model.")
        if "mlp" in names and "mlp" not in layer.mlp_slot.offload_modules:
            raise ValueError(f"modules=['mlp'] offloads a dense MLP; {label} has {type(layer.mlp_slot).__name__}: "
                             f"offload its input instead (modules=['mlp_norm']) or the experts' "
                             f"(modules=['expert_fc1', 'moe_act']), or leave 'mlp' out.")
    named = [n for n in names if n in EXPERT_MODULES]
    if named and not any(set(named) & set(layer.mlp_slot.offload_modules) for layer in layers):
        raise ValueError(f"modules={named} offloads the experts of a mixture; "
                         f"{getattr(layers[0], '_name', type(layers[0]).__name__)} has "
                         f"{type(layers[0].mlp_slot).__name__}: leave {named} out.")
    shared = LayerOffload(names, pool, layer_order(model, layers))
    for layer in layers:
        layer.offload = shared
        # The slot's own regions (a mixture's experts) are the layer's: the same rules apply.
        layer.mlp_slot.offload_within(layer.offloading if named else None)
    return len(layers)


def layer_order(model: nn.Module, layers: list) -> dict[int, int]:
    """``id(layer) → its place in the model's stack of layers``: its index in the one container that holds them, where
    the layers other pipeline ranks hold keep their places (:func:`~lightning_seqpar.pipeline_parallel.stage.
    split_stages` leaves placeholders), so the prefetch links only layers adjacent in the model. Counting a rank's
    own layers instead made its interleaved chunks (layers 0 and 2 of 4 at pp 2, v 2) adjacent, and linked one
    micro-batch's chunk to another's forward just before it, whose copies then came back long before their backward.
    Layers in several containers, or not in one, are counted in order."""
    # (read from the names, not find_layer_stack: once split, a rank's container also holds other ranks' placeholders)
    named = {id(m): name for name, m in model.named_modules()}
    places = [named.get(id(layer), "").rpartition(".") for layer in layers]
    if len({parent for parent, _, _ in places}) == 1 and all(index.isdigit() for _, _, index in places):
        return {id(layer): int(index) for layer, (_, _, index) in zip(layers, places)}
    return {id(layer): i for i, layer in enumerate(layers)}


def check_offload_with_recompute(model: nn.Module) -> None:
    """Refuse a module both offloaded and recomputed (recomputation keeps nothing of it to offload, or rebuilds from
    what it would move: :data:`~lightning_seqpar.memory.conflicts.OFFLOAD_CONFLICTS`).

    Raises:
        ValueError: ``core_attn`` offloaded where core attention is recomputed, ``mlp`` (``expert_fc1``, ``moe_act``)
            where the MLP (the mixture) is, ``moe_act`` where the experts' activation is, or a norm's input where the
            norm's output is rebuilt from it; naming the layer and the fix.
    """
    from lightning_seqpar.recompute.apply import rewritten_layers
    from lightning_seqpar.transformer.core_attention import CoreAttention

    for layer in rewritten_layers(model):
        offload = layer.offload
        if offload is None or layer.checkpointed_whole:
            continue
        experts = getattr(getattr(layer, "_mlp", None), "experts", None)
        # what this layer recomputes, by the names SelectiveRecompute(modules=...) gives it
        recomputed = {name for name, on in (
            ("core_attn", any(isinstance(m, CoreAttention) and m.recompute for m in layer.modules())),
            ("moe" if experts is not None else "mlp", layer.recompute_mlp),
            ("moe_act", getattr(experts, "recompute_activation", False)),
            ("layernorm", layer.recompute_norms)) if on}
        conflict = offload_conflict(offload.names, recomputed)
        if conflict is not None:
            raise ValueError(f"{getattr(layer, '_name', type(layer).__name__)}: {conflict.message(offload.names)}")
