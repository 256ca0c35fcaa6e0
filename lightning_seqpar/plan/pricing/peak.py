"""A layout's peak bytes: each pipeline rank's model state and, at each moment of its step, what its schedule holds
in flight and what that moment makes; the most loaded rank's peak is the layout's.

The moments, in the order a rank's peak is looked for (a later one counts only where it holds more):

- the **optimizer's step**, once the activations are gone (its temporary beside the model state);
- each **backward** a rank's schedule starts (:func:`~.moments.backward_moments`): the micro-batches in flight, the
  gradients made so far, and the larger of that backward's transients and the core attention's;
- just before a last stage's backward, the **loss's forward**: its logits (and their float32 copy) beside the softmax;
- under a pipeline, the **forward** that filled the moment, its last layer's core attention at work;
- without a pipeline, the **next step's forward**, the last step's ``.grad`` still alive (Lightning zeroes it after
  ``training_step``).

What each term was measured against: ``docs/plan.md``, "What the peak's terms were measured against".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_seqpar.pipeline_parallel.schedules import splits_backward
from lightning_seqpar.plan.pricing.activations import weight_gradient_bytes
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.layout_record import LayoutRecord
from lightning_seqpar.plan.pricing.measurements import Measurements
from lightning_seqpar.plan.pricing.memory_choices import largest_offloaded_share, offload_backward_bytes
from lightning_seqpar.plan.pricing.moments import backward_moments
from lightning_seqpar.plan.pricing.kept import (activation_element_bytes, cached_copy_bytes, first_layer_apart,
                                                first_layer_saving, layer_activation_bytes, loss_chunk_positions,
                                                mlp_kept_bytes, never_negative, outside_bytes)
from lightning_seqpar.plan.pricing.state import PARAMETER_BYTES, StateBytes, state_bytes
from lightning_seqpar.plan.pricing.transients import (
    accumulation_bytes,
    attention_backward_bytes,
    backward_transient_bytes,
    context_transient_bytes,
    forward_transient_bytes,
    largest_layer_weight,
    loss_bytes,
)
from lightning_seqpar.parallel.split_sizes import padded_size

Moment = tuple[float, int, float, dict[str, float]]
"""``(total, gradients, activations, other by part)`` bytes of one rank at one moment of its step."""


@dataclass(frozen=True)
class LayoutBytes:
    """What every moment of a layout's step reads (bytes of one rank, per micro-batch where in flight), computed once
    per layout.

    Attributes:
        per_layer: what one layer keeps for its backward.
        moved: what one layer's offload moves (0 without offload).
        prefetched: what a layer's backward holds brought back for the layer below it (offload, more than one layer).
        first_saving: what stage 0's first layer keeps less than the others.
        mlp_kept: what a layer's MLP keeps (freed before its attention's backward).
        cached: autocast's cached 16-bit weight copies of one layer during a split chunk's forward.
        around: a chunk-forward's stage input and prologue; ``first_around`` on stage 0.
        after: the last chunk's epilogue (without a pipeline: everything outside the layers but the logits).
        outside: what a forward keeps outside the layers (stage input, prologue, epilogue).
        epilogue: the final norm's, the head's and the loss's kept bytes, the logits' taken out.
        logits, loss_forward: the loss's (one chunk's with ``loss_chunk``).
        attention_backward, forward: the core attention's backward and forward transients.
        w_held, mlp_w_held: what a micro-batch past its B keeps for its W (the whole layer's, the MLP's).
        backward: a layer's backward transients by ``(last stage, gradients accumulating)``.
    """

    per_layer: float
    moved: float
    prefetched: float
    first_saving: float
    mlp_kept: float
    cached: float
    around: float
    first_around: float
    after: float
    outside: float
    epilogue: float
    logits: float
    loss_forward: float
    attention_backward: float
    forward: float
    w_held: float
    mlp_w_held: float
    backward: dict[tuple[bool, bool], float]


def rank_state(record: LayoutRecord, inventory: ModelInventory, precision: str, optimizer: str, layout: Any,
               rank: int) -> StateBytes:
    """Pipeline rank ``rank``'s model-state bytes under ``record`` (gradients reduced, and ZeRO sharded, over the
    ``d·c`` ranks of the data group)."""
    lay = record.layout
    return state_bytes(inventory, lay.tp, lay.pp, record.dp * lay.cp, pipeline_rank=rank, vpp=lay.virtual_stages,
                       zero=lay.zero, precision=precision, main_params=lay.fp32_main_params, optimizer=optimizer,
                       ep=lay.ep, placement=layout.placement, expert_tp=lay.expert_tp)


def peak_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, dropout: bool,
               measured: Optional[Measurements], optimizer: str, layout: Any) -> float:
    """The most loaded pipeline rank's bytes at its step's peak into ``record`` (``stage``, ``bytes``, ``other``; see
    the module docstring). Returns the bytes one layer's offload moves per micro-batch (0 without offload)."""
    terms = layout_bytes(record, inventory, s, precision, dropout, measured)
    worst: tuple[float, int, dict[str, int], dict[str, int]] = (-1.0, 0, {}, {})
    for rank in range(record.layout.pp):
        state = rank_state(record, inventory, precision, optimizer, layout, rank)
        _, gradients, activations, other = _rank_peak(record, terms, state, layout, rank, precision)
        parts = {k: int(v) for k, v in other.items() if v}
        split = dict(parameters=state.parameters, gradients=gradients, main_params=state.main_params,
                     optimizer=state.optimizer,
                     activations=int(never_negative("the activations", activations, record)), other=sum(parts.values()))
        split["total"] = sum(split.values())
        if split["total"] > worst[0]:
            worst = (split["total"], rank, split, parts)
    _, record.stage, record.bytes, record.other = worst
    return terms.moved


def layout_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, dropout: bool,
                 measured: Optional[Measurements]) -> LayoutBytes:
    """The :class:`LayoutBytes` of ``record`` at ``s`` tokens (a context-parallel rank's layers see ``s/c``)."""
    tp, pp, vpp, cp = record.layout.tp, record.layout.pp, record.layout.virtual_stages, record.layout.cp
    b = record.micro_batch
    local = s // cp
    element = activation_element_bytes(precision)
    per_layer = layer_activation_bytes(record, inventory, s, precision, dropout, measured)
    # What a layer's backward makes again or brings back: its kept bytes without recomputation and offload, less
    # with them. Of it, what the offload moves (the same layer's bytes with and without it).
    moved = recomputed = prefetched = 0.0
    if record.layout.recompute != "none" or record.layout.recompute_modules:
        whole = replace(record, layout=record.layout.replace(recompute="none", recompute_modules=()))
        kept_whole = layer_activation_bytes(whole, inventory, s, precision, dropout, measured)
        recomputed = max(0.0, kept_whole - per_layer)
        if record.layout.recompute == "selective":
            # the core attention's part is remade in its own backward, after the layer's MLP backward: its moment
            # prices it (attention_backward), not the layer's (not beside the MLP's inner gradients)
            plain = replace(record, layout=record.layout.replace(recompute_modules=(), offload=()))
            core = max(0.0, kept_whole - layer_activation_bytes(plain, inventory, s, precision, dropout, measured))
            recomputed = max(0.0, recomputed - core)
    if record.layout.offload:
        unloaded = layer_activation_bytes(replace(record, layout=record.layout.replace(offload=())), inventory, s,
                                          precision, dropout, measured)
        moved = max(0.0, unloaded - per_layer)
        recomputed += offload_backward_bytes(moved, per_layer, inventory.num_layers // (pp * vpp),
                                             largest_offloaded_share(inventory, local, b, tp, record, element, dropout))
        prefetched = moved * (inventory.num_layers // (pp * vpp) > 1)
    probed = measured is not None and inventory.config is not None
    # Under a split backward no micro-batch keeps autocast's 16-bit weight copies (per_layer is without them), but a
    # chunk's forward holds its layers' copies in autocast's cache until its region ends, the loss's forward included.
    cached = cached_copy_bytes(inventory, record, precision) if probed else 0
    parameter = PARAMETER_BYTES[precision]
    outside, prologue = outside_bytes(record, inventory, s, precision, element, measured)
    # Outside the layers, a forward keeps the stage input ([s/t, b, h]: what a pipeline stage received), the prologue
    # (mask, rotary tables, position ids) and the epilogue (final norm, head, loss). Under a pipeline every
    # chunk-forward keeps an input and a prologue of its own; only the last chunk an epilogue. Where the first layer
    # is fitted apart (frozen parameters), it holds its own input (none, or the layers' [s, b, h] copy of the
    # embedding's output that its checkpoint keeps), which the fitted outside leaves out.
    stage_input = element * local * b * inventory.hidden_size / tp
    apart = probed and first_layer_apart(inventory.training)
    epilogue = max(0.0, outside - prologue - (0.0 if apart else stage_input))
    # The head's logits live from the head to the end of the loss's forward: a micro-batch keeps the rest. In chunks
    # (loss_chunk), it keeps neither them nor the softmax, and the loss's forward and backward make one chunk's.
    positions, vocab_parallel = loss_chunk_positions(record, inventory, local), tp > 1 or cp > 1
    logits, loss_forward, loss_backward = loss_bytes(inventory, local, b, tp, element, vocab_parallel)
    kept_logits = logits if positions is None else logits + 4 * logits / element  # the logits, and the softmax kept
    kept_logits = min(kept_logits, epilogue)
    epilogue -= kept_logits
    around, after = (0.0, outside - kept_logits) if pp == 1 else (stage_input + prologue, epilogue)
    first_around = around - (stage_input if pp > 1 and apart else 0.0)  # (apart, the first layer holds its input)
    gradient = parameter + (2 if precision == "bf16-mixed" else 0)  # autocast's 16-bit weight gradient + its fp32 copy
    if positions is not None:  # a chunk's logits, their float32 copy and softmax, then (made again) its gradient
        logits, loss_forward, loss_backward = loss_bytes(inventory, positions, b, tp, element, vocab_parallel)
        loss_forward += 4 * logits / element
        # Each chunk's head weight gradient is added to the sum of the later chunks' (autograd's buffer): the sum,
        # the new one and their total at once, in the parameters' dtype, beside the chunk's logits' gradient.
        head = 3 * parameter * (padded_size(inventory.vocab_size, tp) // tp) * inventory.hidden_size
        loss_backward = max(logits + loss_forward, 4 * logits / element + loss_backward,
                            head + 4 * logits / element)
    largest = largest_layer_weight(inventory, tp, record.layout.ep, record.layout.expert_tp)
    if cp == 1:
        attention_backward = attention_backward_bytes(inventory, s, b, tp, precision, record.layout.recompute)
        forward = forward_transient_bytes(inventory, s, b, tp, precision, record.layout.recompute)
    else:
        attention_backward = context_transient_bytes(inventory, s, b, tp, cp, precision, True, record.layout.cp_comm)
        forward = context_transient_bytes(inventory, s, b, tp, cp, precision, False, record.layout.cp_comm)
    # a micro-batch past its B (a split backward): what its W reads, the split linears' inputs and output gradients
    split = splits_backward(record.layout.schedule)
    w_held = weight_gradient_bytes(inventory, local, b, tp, True, element) if split else 0.0
    mlp_w_held = weight_gradient_bytes(inventory, local, b, tp, True, element, ("mlp",)) if w_held else 0.0
    backward = {(last, accumulating): backward_transient_bytes(
        inventory, local, b, tp, element, gradient, last, accumulating, recomputed, largest=largest, freed=epilogue,
        loss=loss_backward, expert_tp=record.layout.expert_tp)
        for last in (False, True) for accumulating in (False, True)}
    first_saving = first_layer_saving(record, inventory, local, precision, measured)
    mlp_kept = mlp_kept_bytes(record, inventory, local, precision, measured)
    return LayoutBytes(per_layer, moved, prefetched, first_saving, mlp_kept, cached, around, first_around, after,
                       outside, epilogue, logits, loss_forward, attention_backward, forward, w_held, mlp_w_held,
                       backward)


def _rank_peak(record: LayoutRecord, terms: LayoutBytes, state: StateBytes, layout: Any, rank: int,
               precision: str) -> Moment:
    """Pipeline rank ``rank``'s largest :data:`Moment` over its step (the module docstring's order)."""
    pp, m, zero = record.layout.pp, record.layout.num_microbatches, record.layout.zero
    parameter = PARAMETER_BYTES[precision]
    stages = layout.stages_of(rank)
    sizes = [layout.sizes[k] for k in stages]
    held_layers, final = sum(sizes), layout.num_stages - 1
    # (`.grad` exists for trained parameters only: LoRA's frozen base makes none)
    accumulated = accumulation_bytes(state.trained, m, state.bucketed, zero == 0 and parameter < 4)
    # `.grad` a step's first backward has not made yet (where the buckets are not the gradients).
    unmade = state.gradients if not state.bucketed else (state.trained if zero == 0 and parameter < 4 else 0)
    # what a micro-batch in flight keeps on each of this rank's chunks
    chunk_kept = [sizes[c] * terms.per_layer + (terms.first_around - terms.first_saving if stage == 0 else terms.around)
                  + (terms.after if stage == final else 0.0) for c, stage in enumerate(stages)]
    base = state.total - state.gradients
    peak: Moment = (state.total + state.temporary, state.gradients, 0.0, {"optimizer": state.temporary})
    moments = backward_moments(record.layout.schedule, m, pp, record.layout.virtual_stages, rank)
    for counts, chunk, made, waiting in moments:
        # the share of this rank's gradients that exist (a split backward makes a chunk's in its first W)
        share = sum(size for size, ok in zip(sizes, made) if ok) / held_layers
        kept = sum(n * held for n, held in zip(counts, chunk_kept))
        kept += sum(n * size * terms.w_held for n, size in zip(waiting, sizes))
        # before a chunk's first backward (a split chunk's first W) its weights have no `.grad`; the buckets,
        # where they are the gradients, exist from the first step on
        gradients = state.gradients - round((1 - share) * unmade)
        accumulating = {"accumulated_gradients": accumulated * share}
        last = stages[chunk] == final
        moments = [(kept, {"backward": _backward(record, terms, sizes[chunk], last, share > 0), **accumulating})]
        if last:  # just before: the loss's forward, its logits (and their float32 copy) beside the softmax
            moments.append((kept, {"loss_forward": terms.logits + terms.loss_forward + terms.cached * sizes[chunk],
                                   **accumulating}))
        if pp > 1:  # the forward that filled this moment, its last layer's core attention at work: half that
            # layer's own kept bytes made (its attention's inputs, not its MLP's)
            moments.append((kept - terms.per_layer / 2, {"forward": terms.forward + terms.cached * max(sizes),
                                                         **accumulating}))
        for held, other in moments:
            total = base + gradients + held + sum(other.values())
            if total > peak[0]:
                peak = (total, gradients, held, other)
    if pp == 1:  # Lightning zeroes .grad after training_step: the last step's live through the forward
        # The head and loss not run yet; half the last layer's own kept bytes made, as above.
        kept = (sizes[0] - 0.5) * terms.per_layer - terms.first_saving + terms.outside - terms.epilogue
        if state.total + kept + terms.forward > peak[0]:
            peak = (state.total + kept + terms.forward, state.gradients, kept, {"forward": terms.forward})
    return peak


def _backward(record: LayoutRecord, terms: LayoutBytes, layers: int, last: bool, accumulating: bool) -> float:
    """What a backward of a chunk of ``layers`` layers makes beside what is in flight: its transients, or the explicit
    core attention's backward's beyond what was freed before it (``last``: the last stage's, after the head's;
    ``accumulating``: into gradients a backward before it made)."""
    # The explicit core attention's backward comes after the head's backward freed the epilogue and, when it is
    # recomputed, after its layer's MLP backward freed that half of the layer's kept bytes (kept probabilities are
    # the attention's own, and stay until it runs): its temporaries count beyond that. Under a split backward the
    # MLP's B leaves what its W reads in that half's place (a frozen MLP's W reads nothing: LoRA frees the half).
    halved = record.layout.recompute != "none" or bool(record.layout.recompute_modules or record.layout.offload)
    # Kept whole, a layer's MLP frees what it kept before the attention's backward too (its probed share).
    spent = max(0.0, (terms.per_layer / 2 if halved else terms.mlp_kept) - terms.mlp_w_held) + (
        terms.epilogue if last else 0.0)
    # Under a split backward, each of the chunk's layers through B holds what its W reads in place of what it kept,
    # more than that where it recomputes: by the chunk's first layer, all but one hold it.
    through = (layers - 1) * max(0.0, terms.w_held - terms.per_layer)
    return through + max(terms.backward[last, accumulating], terms.attention_backward - spent + terms.prefetched)
