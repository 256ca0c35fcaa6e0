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
from lightning_seqpar.transformer.roles import LayerStack, ParallelLayer


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
    * ``"none"``: undo either.

    Raises:
        ValueError: for an unknown granularity/method, ``num_layers < 1``, uniform chunks of more than one
            layer on layers that are not inside a stack module, or a model with no layer to recompute.
    """
    if granularity not in ("selective", "full", "none"):
        raise ValueError(f"granularity must be 'selective', 'full' or 'none', got {granularity!r}.")
    if method not in ("uniform", "block"):
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}.")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    attentions = [m for m in model.modules() if isinstance(m, CoreAttention)]
    stacks, layers = _layer_stacks(model)
    for m in attentions:
        m.recompute = granularity == "selective"
    for stack in stacks:
        stack.recompute_chunks = []
    for layer in layers:
        layer.recompute_layer = False
    for layer in rewritten_layers(model):
        layer.recompute_mlp = layer.recompute_norms = False  # module recomputation (apply_recompute_modules) undone too
        if layer.mlp_slot is not None:
            layer.mlp_slot.recompute_within(())
        layer.checkpointed_whole = False
    if granularity == "none":
        return 0
    if granularity == "selective":
        if not attentions and not any(layer.fused_attention for layer in layers):
            raise ValueError("Selective recomputation found no CoreAttention module: is the model rewritten?")
        return len(attentions)  # layers with a fused kernel keep no s² tensor: nothing to recompute there
    if not stacks and not layers:
        raise ValueError("Full recomputation found no rewritten transformer layer in the model.")
    count = 0
    for stack in stacks:
        n = len(stack.stack_layers())
        if method == "uniform":
            size = num_layers or 1
            stack.recompute_chunks = [(i, min(i + size, n)) for i in range(0, n, size)]
        else:
            stack.recompute_chunks = [(i, i + 1) for i in range(min(num_layers or n, n))]
        count += len(stack.recompute_chunks)
        for lo, hi in stack.recompute_chunks:
            for layer in stack.stack_layers()[lo:hi]:
                layer.checkpointed_whole = True
    if layers and method == "uniform" and (num_layers or 1) > 1:
        raise ValueError(
            f"Uniform chunks of {num_layers} layers need the layers inside a stack (nn.TransformerEncoder or the "
            f"reference GPT) on one pipeline stage; these layers are called one by one by user code or split over "
            f"pipeline stages. Use num_layers=1 or method='block'."
        )
    chosen = layers if method == "uniform" else layers[: num_layers or len(layers)]
    for layer in chosen:
        layer.recompute_layer = layer.checkpointed_whole = True
    return count + len(chosen)


def _outside_full(model: nn.Module) -> list[ParallelLayer]:
    """The rewritten layers that are not checkpointed whole (in no stack's recompute chunk, not recompute_layer)."""
    stacks, layers = _layer_stacks(model)
    outside = [layer for stack in stacks for i, layer in enumerate(stack.stack_layers())
               if not any(lo <= i < hi for lo, hi in stack.recompute_chunks)]
    return outside + [layer for layer in layers if not layer.recompute_layer]


def _selective_outside_full(model: nn.Module) -> None:
    """Turn on selective recomputation in every layer that is not checkpointed whole."""
    for layer in _outside_full(model):
        for m in layer.modules():
            if isinstance(m, CoreAttention):
                m.recompute = True


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
        apply_recompute(model, "full", "block", plan.full_layers)
        if plan.full_layers < len(rewritten_layers(model)):
            _selective_outside_full(model)
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


def _check_rebuilds(layers: list[ParallelLayer], names: list[str]) -> None:
    """Raises ``ValueError`` for a layer whose outputs ``names`` cannot rebuild: norms' outputs outside a pre-norm
    parallel block (a post-norm block's norm output is the residual stream itself), or a compiled block (the rebuild's
    saved-tensor hooks run in Python)."""
    for layer in layers:
        label = getattr(layer, "_name", type(layer).__name__)
        if "layernorm" in names and not getattr(layer, "norm_first", False):
            raise ValueError(f"modules=['layernorm'] rebuilds the outputs of the norms before attention and MLP; {label} "
                             f"normalizes after the residual (post-norm), where the norm's output is the residual "
                             f"stream: leave 'layernorm' out.")
        if layer.compile_config is not None:
            raise ValueError(f"modules={names} with compiled blocks (compile=True): the rebuild's saved-tensor hooks run "
                             f"in Python, outside the graph. Train with compile=False, or leave {names} out.")


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
    if "layernorm" in names or "moe_act" in names:
        _check_rebuilds(layers, [n for n in names if n in ("layernorm", "moe_act")])
    count = apply_recompute(model, "full" if "full" in names else "none", method, num_layers)
    outside = {id(layer) for layer in _outside_full(model)}
    for layer, slot in zip(layers, slots):
        inside = id(layer) not in outside  # checkpointed whole: its modules are recomputed with it already
        layer.recompute_mlp = slot is not None and slot.kind in names and not inside
        layer.recompute_norms = "layernorm" in names and not inside
        if slot is not None and not inside and not layer.recompute_mlp:  # recomputed whole: its parts are already
            count += slot.recompute_within([n for n in names if n in slot.recompute_modules and n != slot.kind])
        count += layer.recompute_mlp + layer.recompute_norms
        for m in layer.modules():
            if isinstance(m, CoreAttention):
                m.recompute = "core_attn" in names and not inside
                count += m.recompute
    if count == 0:
        raise ValueError(f"modules={names!r} found nothing to recompute: is the model rewritten? (Layers with a fused "
                         f"attention kernel keep no s² tensor for core_attn to drop.)")
    return count
