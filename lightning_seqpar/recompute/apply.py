"""Configure activation recomputation on a rewritten model: selective (core attention), full (whole
layers) or a plan chosen from a memory budget. The Lightning callback is
:class:`lightning_seqpar.SelectiveRecompute`."""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch.nn as nn

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.conflicts import RECOMPUTE_MODULES
from lightning_seqpar.recompute.planner import RecomputePlan
from lightning_seqpar.transformer.core_attention import CoreAttention
from lightning_seqpar.transformer.roles import LayerStack, ParallelLayer, set_layer_memories


def _is_split(stack: LayerStack) -> bool:
    return any(isinstance(m, ParallelLayer) and m.pipeline_stage is not None for m in stack.stack_layers())


def _layer_stacks(model: nn.Module) -> tuple[list[LayerStack], list[ParallelLayer]]:
    """(layer stacks, layers outside any stack) of a rewritten model.

    A stack split over pipeline stages counts as bare layers: a checkpointed chunk must not span a
    stage boundary, so each held layer is checkpointed on its own.
    """
    stacks = [m for m in model.modules() if isinstance(m, LayerStack) and not _is_split(m)]
    inside = {id(layer) for stack in stacks for layer in stack.stack_layers()}
    layers = [m for m in model.modules() if isinstance(m, ParallelLayer) and id(m) not in inside]
    return stacks, layers


def fused_attention_layers(model: nn.Module) -> list[ParallelLayer]:
    """The rewritten layers whose core attention is a fused kernel (selective recomputation skips them)."""
    return [m for m in model.modules() if isinstance(m, ParallelLayer) and m.fused_attention]


def apply_recompute(
    model: nn.Module,
    granularity: Literal["selective", "full", "none"] = "selective",
    method: Literal["uniform", "block"] = "uniform",
    num_layers: Optional[int] = None,
) -> int:
    """Configure recomputation on every rewritten layer of ``model``; return how many places it set.

    * ``"selective"``: checkpoint each :class:`CoreAttention` (QKᵀ, softmax, softmax dropout, ·V),
      Korthikanti et al. 2022 §5.
    * ``"full"``: checkpoint whole layers, Megatron's ``--recompute-method``:
      ``"uniform"`` checkpoints every chunk of ``num_layers`` consecutive layers (default 1);
      ``"block"`` checkpoints the first ``num_layers`` layers of each stack individually (default all).
    * ``"none"``: undo either (and recomputation by module).

    Each layer's :class:`~lightning_seqpar.memory.layer_memory.LayerMemory` is replaced whole, its offload kept.

    Raises:
        ValueError: for an unknown granularity/method, ``num_layers < 1``, uniform chunks of more than one
            layer on layers that are not inside a stack module, a model with no layer to recompute, or what a layer
            refuses (:meth:`~lightning_seqpar.transformer.roles.ParallelLayer.memory_refusal`: its offload with
            core attention recomputed); nothing is changed then.
    """
    if granularity not in ("selective", "full", "none"):
        raise ValueError(f"granularity must be 'selective', 'full' or 'none', got {granularity!r}.")
    _check_method(method, num_layers)
    if granularity == "selective":
        attentions = [m for m in model.modules() if isinstance(m, CoreAttention)]
        if not attentions and not fused_attention_layers(model):
            raise ValueError("Selective recomputation found no CoreAttention module: is the model rewritten?")
    full = (method, num_layers) if granularity == "full" else None
    return _set_recompute(model, full, ("core_attn",) if granularity == "selective" else ())


def _check_method(method: str, num_layers: Optional[int]) -> None:
    if method not in ("uniform", "block"):
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}.")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")


def _full_chunks(stacks: list[LayerStack], layers: list[ParallelLayer], method: str, num_layers: Optional[int]
                 ) -> tuple[dict[int, list[tuple[int, int]]], list[ParallelLayer]]:
    """Full recomputation's choice over ``stacks`` and the layers outside them (:func:`_layer_stacks`): ``id(stack) →
    its checkpointed chunks`` and the bare layers that checkpoint themselves (Megatron's ``uniform``/``block``)."""
    if not stacks and not layers:
        raise ValueError("Full recomputation found no rewritten transformer layer in the model.")
    if layers and method == "uniform" and (num_layers or 1) > 1:
        raise ValueError(
            f"Uniform chunks of {num_layers} layers need the layers inside a stack (nn.TransformerEncoder or the "
            f"reference GPT) on one pipeline stage; these layers are called one by one by user code or split over "
            f"pipeline stages. Use num_layers=1 or method='block'."
        )
    chunks = {}
    for stack in stacks:
        n = len(stack.stack_layers())
        size = num_layers or 1
        chunks[id(stack)] = ([(i, min(i + size, n)) for i in range(0, n, size)] if method == "uniform"
                             else [(i, i + 1) for i in range(min(num_layers or n, n))])
    return chunks, (layers if method == "uniform" else layers[: num_layers or len(layers)])


def _parts(layer: ParallelLayer) -> set[str]:
    """The recomputation-by-module names ``layer`` has a part for (``layernorm`` always: the layer refuses it where
    its norms cannot be rebuilt)."""
    names = {"layernorm"} | ({"core_attn"} if any(isinstance(m, CoreAttention) for m in layer.modules()) else set())
    return names | set(layer.mlp_slot.recompute_modules if layer.mlp_slot is not None else ())


def _set_recompute(model: nn.Module, full: Optional[tuple[str, Optional[int]]], modules: Sequence[str]) -> int:
    """Replace every rewritten layer's recomputation: whole layers as ``full`` (``(method, num_layers)``) chooses,
    ``modules`` recomputed in the others; the stacks' chunks and any core attention outside a layer follow. Returns
    the places set (chunks, self-checkpointing layers, modules)."""
    stacks, bare = _layer_stacks(model)
    chunks, own = _full_chunks(stacks, bare, *full) if full is not None else ({}, [])
    whole = {id(layer) for stack in stacks for lo, hi in chunks.get(id(stack), ())
             for layer in stack.stack_layers()[lo:hi]} | {id(layer) for layer in own}
    mine = {id(layer) for layer in own}
    layers = rewritten_layers(model)
    policies, count = [], sum(map(len, chunks.values())) + len(own)
    for layer in layers:
        inside = id(layer) in whole
        names = frozenset() if inside else frozenset(modules) & _parts(layer)
        if layer.mlp_slot is not None and layer.mlp_slot.kind in names:  # recomputed whole: its parts are already
            names -= set(layer.mlp_slot.recompute_modules) - {layer.mlp_slot.kind}
        policies.append((layer, layer.memory.replace(whole=inside, checkpoints_itself=id(layer) in mine,
                                                     recompute=names)))
        attentions = sum(isinstance(m, CoreAttention) for m in layer.modules())
        count += len(names - {"core_attn"}) + attentions * ("core_attn" in names)
    set_layer_memories(policies)
    for stack in stacks:
        stack.recompute_chunks = chunks.get(id(stack), [])
    inside_layers = {id(m) for layer in layers for m in layer.modules()}
    for m in model.modules():  # a core attention no rewritten layer holds (a user's own module)
        if isinstance(m, CoreAttention) and id(m) not in inside_layers:
            m.recompute = "core_attn" in modules
            count += m.recompute
    return count


def recompute_counts(model: nn.Module) -> tuple[int, int]:
    """(layers with selective recomputation, layers checkpointed whole) of a rewritten model."""
    stacks, layers = _layer_stacks(model)
    full = sum(hi - lo for stack in stacks for lo, hi in stack.recompute_chunks)
    full += sum(1 for layer in layers if layer.recompute_layer)
    selective = sum(1 for m in model.modules() if isinstance(m, CoreAttention) and m.recompute)
    return selective, full


def micro_batch_shape(batch: Any) -> tuple[int, int]:
    """(s, b) of a batch whose first tensor (or the batch itself) is token ids ``[b, s]``."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    b, s = tokens.shape[-2:]
    return s, b


def rewritten_layers(model: nn.Module) -> list[ParallelLayer]:
    """The rewritten transformer layers of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, ParallelLayer)]


def model_shape(model: nn.Module, s: int, b: int) -> tuple[TransformerShape, int, bool]:
    """(shape, t, sequence_parallel) of a rewritten model, for sequences of ``s`` tokens in micro-batches of ``b``.

    Raises:
        ValueError: no rewritten layer in ``model``.
    """
    layers = rewritten_layers(model)
    if not layers:
        raise ValueError("granularity='auto' found no rewritten transformer layer: is the model rewritten?")
    dims = layers[0].layer_dims()
    shape = TransformerShape(s=s, b=b, h=dims.hidden_size, a=dims.num_heads, L=len(layers),
                             ffn_hidden_size=dims.ffn_hidden_size, num_kv_heads=dims.num_kv_heads,
                             gated_mlp=dims.gated_mlp)
    return shape, dims.tp, dims.sequence_parallel


def apply_recompute_plan(model: nn.Module, plan: RecomputePlan) -> None:
    """Apply a :class:`RecomputePlan`: full recomputation of its first layers, selective on the rest."""
    if plan.full_layers:
        _set_recompute(model, ("block", plan.full_layers), ("core_attn",))
    else:
        apply_recompute(model, plan.granularity)


def module_names(modules: Any, known: Sequence[str]) -> list[str]:
    """``modules`` (a name or names) as a list, checked against ``known``.

    Raises:
        ValueError: no module named, or a name not in ``known``.
    """
    names = [modules] if isinstance(modules, str) else list(modules or [])
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"modules={modules!r}: " + (f"{unknown} are not modules; " if unknown else "")
                         + f"name at least one of {list(known)}.")
    return names


def check_recompute_modules(modules: Any) -> list[str]:
    """``modules`` (a name or names) as a list, checked: names of :data:`RECOMPUTE_MODULES` (:func:`module_names`)."""
    return module_names(modules, RECOMPUTE_MODULES)


def apply_recompute_modules(model: nn.Module, modules: Any, method: Literal["uniform", "block"] = "uniform",
                            num_layers: Optional[int] = None) -> int:
    """Recompute the named modules of every rewritten layer of ``model`` (any combination of
    :data:`RECOMPUTE_MODULES`); with ``"full"``, the layers :func:`apply_recompute` checkpoints whole (``method``,
    ``num_layers``) and the named modules in the others. Returns how many places it set. Exact: the dropout masks are
    drawn again from the streams they were drawn from.

    Raises:
        ValueError: no module named, a name not in :data:`RECOMPUTE_MODULES` (those Megatron-Core has that this does
            not yet, named as such), ``"mlp"`` on a model without a dense MLP or ``"moe"`` on one without a mixture of
            experts (naming a layer and the module it has), or a model with nothing to recompute (see
            :func:`apply_recompute`).
    """
    names = check_recompute_modules(modules)
    layers = rewritten_layers(model)
    slots = [layer.mlp_slot for layer in layers]
    what = {"mlp": "a dense MLP", "moe": "a mixture of experts", "moe_act": "the experts' activation",
            "shared_experts": "a mixture's shared expert"}
    for name in (n for n in names if n in what):
        if layers and not any(slot is not None and name in slot.recompute_modules for slot in slots):
            label, slot = getattr(layers[0], "_name", type(layers[0]).__name__), slots[0]
            if name == "shared_experts" and any(slot is not None and slot.kind == "moe" for slot in slots):
                raise ValueError(f"modules=['shared_experts'] recomputes {what[name]}; {label} has none: leave "
                                 f"'shared_experts' out.")
            other = "moe" if name == "mlp" else "mlp"
            raise ValueError(f"modules=['{name}'] recomputes {what[name]}; {label} has {type(slot).__name__}: "
                             f"recompute it with modules=['{other}'] or whole (modules=['full']), or leave '{name}' "
                             f"out.")
    _check_method(method, num_layers)
    count = _set_recompute(model, (method, num_layers) if "full" in names else None,
                           [n for n in names if n != "full"])
    if count == 0:
        raise ValueError(f"modules={names!r} found nothing to recompute: is the model rewritten? (Layers with a fused "
                         f"attention kernel keep no s² tensor for core_attn to drop.)")
    return count
