"""Which modules of the rewritten layers offload what they save for backward (Megatron-Core's ``--offload-modules``).

A module offloads *the tensors autograd saves while it runs*: for a norm, its input (and statistics); for a linear,
its input; for core attention, q, k, v and what softmax and dropout keep. Parameters and buffers stay where they are.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.memory.conflicts import EXPERT_MODULES, OFFLOAD_MODULES
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
    offload nothing. Each layer's :class:`~lightning_seqpar.memory.layer_memory.LayerMemory` is replaced whole, its
    recomputation kept.

    Raises:
        ValueError: see :func:`check_offload_modules`; no rewritten layer; expert modules named on a model without a
            mixture of experts; what a layer refuses (:meth:`~lightning_seqpar.transformer.roles.ParallelLayer.
            memory_refusal`: a layer that is not a parallel block, ``"mlp"`` where its MLP is a mixture, a compiled
            body, a module it recomputes), by name with the fix. Nothing is changed then.
    """
    from lightning_seqpar.recompute.apply import rewritten_layers
    from lightning_seqpar.transformer.roles import set_layer_memories

    layers = rewritten_layers(model)
    if modules is None:
        set_layer_memories([(layer, layer.memory.replace(offload=None)) for layer in layers])
        return 0
    names = check_offload_modules(modules)
    if not layers:
        raise ValueError("Activation offload found no rewritten transformer layer in the model: is it rewritten?")
    named = [n for n in names if n in EXPERT_MODULES]
    if named and not any(set(named) & set(getattr(layer.mlp_slot, "offload_modules", ())) for layer in layers):
        raise ValueError(f"modules={named} offloads the experts of a mixture; "
                         f"{getattr(layers[0], '_name', type(layers[0]).__name__)} has "
                         f"{type(layers[0].mlp_slot).__name__}: leave {named} out.")
    shared = LayerOffload(names, pool, layer_order(model, layers))
    set_layer_memories([(layer, layer.memory.replace(offload=shared)) for layer in layers])
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
