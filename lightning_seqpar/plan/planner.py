"""Every layout of a model on N GPUs, feasible or not and why, ranked by predicted step time.

:func:`plan` enumerates tensor, pipeline (with virtual stages) and data parallel sizes, ZeRO, micro-batch size and
recomputation; checks each against the strategy's rules (the reason of each rejection in the field's words); for each
feasible one predicts, per pipeline rank, the model-state bytes (exact: :mod:`.state`), the activations of the
micro-batches in flight (a layer's bytes measured on small copies of the model and scaled, :mod:`.probe`; Table 2's
model, :mod:`.activations`, where the model cannot be probed), the communication buffers, the FLOPs, the bytes per collective kind and
the step time (:mod:`.cost`); a layout fits when its most loaded rank stays within ``headroom × memory`` (0.8 by
default: Fujii et al. found no run under 80 % of device memory that ran out).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace
from typing import Any, Optional, Union

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.flops import hardware_flops_per_iteration, mlp_forward_flops, model_flops_per_iteration
from lightning_seqpar.optim.grad_buckets import DEFAULT_BUCKET_BYTES
from lightning_seqpar.pipeline_parallel.schedules import (
    bubble_fraction, resolve_schedule, runs_at, splits_backward, stage_placement_of,
)
from lightning_seqpar.plan.activations import weight_gradient_bytes
from lightning_seqpar.plan.cost import Hardware, Traffic, attention_flops, ring_bytes, step_times
from lightning_seqpar.plan.experts import (  # noqa: F401  (expert_parallel_sizes: the planner's, re-exported)
    all_to_all_bytes, expert_grids, expert_parallel_sizes,
)
from lightning_seqpar.plan.inventory import ModelInventory
from lightning_seqpar.plan.layout_record import LayoutRecord
from lightning_seqpar.plan.memory_choices import (describe, host_traffic, largest_offloaded_share, memory_choice_rule,
                                                  offload_backward_bytes, trades)
from lightning_seqpar.plan.moments import backward_moments, chunks_rule
from lightning_seqpar.plan.pricing import (activation_element_bytes, cached_copy_bytes, elementwise_work,
                                           first_layer_saving, layer_activation_bytes, loss_chunk_positions,
                                           mlp_kept_bytes, never_negative, outside_bytes)
from lightning_seqpar.plan.probe import first_layer_apart
from lightning_seqpar.plan.rules import divisors, layout_rule
from lightning_seqpar.plan.muon_cost import muon_step_cost
from lightning_seqpar.plan.state import (OPTIMIZER_STATES, PARAMETER_BYTES, StateBytes, held_entries, stage_layout,
                                         state_bytes, trained_elements)
from lightning_seqpar.plan.transients import (
    accumulation_bytes,
    attention_backward_bytes,
    backward_transient_bytes,
    context_transient_bytes,
    forward_transient_bytes,
    largest_layer_weight,
    loss_bytes,
)
from lightning_seqpar.tensor_parallel.sharding import padded_size

RECOMPUTE = ("selective", "none", "full")
VIRTUAL_STAGES = (1, 2, 4, 5)


def plan(inventory: ModelInventory, gpus: int, seq_len: int, global_batch: int, *, hardware: Hardware = Hardware(),
         precision: str = "bf16-mixed", headroom: float = 0.8, schedule: Union[str, tuple[str, ...]] = "1F1B",
         micro_batches: tuple[int, ...] = (1, 2, 4), attention_dropout: bool = False,
         calibrate: bool = True, fits: Optional[dict[tuple, Any]] = None,
         optimizer: str = "adamw", per_rank_batch: bool = False,
         context_parallel: Optional[tuple[int, ...]] = None, cp_comm: str = "ring",
         memory_choices: bool = False, memory_choices_on: Optional[int] = None,
         loss_chunk: Union[Optional[int], tuple[Optional[int], ...]] = 4096,
         state_floor: bool = False) -> list[LayoutRecord]:
    """Every layout of ``inventory`` on ``gpus`` GPUs, feasible ones first by predicted step time, then the rejected.

    Args:
        seq_len: s, tokens per sequence. global_batch: sequences per optimizer step.
        precision: ``bf16-mixed``, ``bf16-true`` (with float32 main params under zero 1), ``32-true``.
        headroom: the fraction of ``hardware.memory`` a feasible layout may fill.
        schedule: the pipeline schedule of layouts with ``pp > 1``, or several to search (``("1F1B", "ZB-H1",
            "ZB-V", "DualPipeV")``): ``1F1B`` is the interleaved one where ``vpp > 1``; ``ZB-H1`` runs one chunk per
            rank, ``ZB-V`` two in a V (vpp 2; its bubble ``(p − 1)/(6m + p − 1)``, its rank 0 the embedding's and the
            loss's), ``DualPipeV`` the same V from ``m >= 2p``, one chunk micro-batch more in flight. A record's
            ``schedule`` is the one it was priced with (``1F1B`` without a pipeline).
        calibrate: a layer's activation bytes measured on small copies of the model and scaled
            (:mod:`~lightning_seqpar.plan.probe`; a Hugging Face model), else the analytic model
            (:mod:`~lightning_seqpar.plan.activations`).
        fits: the probes' cache, shared between calls (its own when not given), for any models: a fit is keyed by
            the model's config (:attr:`~.inventory.ModelInventory.probe_key`) and the layout.
        optimizer: ``adamw`` (the default), ``adam``, ``sgd`` (with momentum): its state per parameter element;
            ``muon`` (``optim.name=muon``): momentum on the layers' matrices, AdamW on the rest, its Newton–Schulz
            FLOPs and gather traffic in the step (:mod:`.muon_cost`).
        per_rank_batch: ``global_batch`` is per data-parallel rank (a Lightning loader's batch): each layout's global
            batch is ``global_batch × dp``.
        context_parallel: the context-parallel sizes c to consider (``None``: every divisor of the GPUs), with
            ``cp_comm`` (``ring`` or ``all_to_all``).
        memory_choices: a layout too large for the GPU is tried again with recomputation by module and activation
            offload (:func:`~.memory_choices.trades`); those that fit compete with the rest by step time (the offload's
            host-link time and the MLP's recomputed FLOPs counted), their ``why`` saying what they replaced.
        memory_choices_on: with ``memory_choices``, try them on the ``memory_choices_on`` smallest layouts too large
            for the GPU that allow them (not under full recomputation) instead of on every one: whether memory
            choices make anything fit, at the probes of a few layouts (the command line's hint when nothing fits).
        loss_chunk: the strategy's ``loss_chunk`` (positions of the loss's logits at a time; ``None``: whole), each
            record's (:attr:`LayoutRecord.loss_chunk`); or several to search (``(4096, None)``): a layout is priced
            once per value that computes its loss differently (none of them past its positions per rank: once).
        state_floor: a layout whose model state alone exceeds ``headroom × hardware.memory`` is rejected without
            pricing its activations (its record's :attr:`~.layout_record.LayoutRecord.state_floor`): whether anything
            fits, and what fits, at the probes of those whose state leaves room (the command line's hints).

    Raises:
        ValueError: ``gpus``, ``seq_len`` or ``global_batch`` below 1, or an unknown precision or optimizer.
    """
    if gpus < 1 or seq_len < 1 or global_batch < 1:
        raise ValueError(f"gpus, seq_len and global_batch must be >= 1; got {gpus}, {seq_len}, {global_batch}.")
    _check(precision, optimizer)
    records = []
    candidates: list[tuple[LayoutRecord, tuple]] = []  # too large, to trade on after all are priced
    fits = {} if fits is None else fits
    schedules = (schedule,) if isinstance(schedule, str) else tuple(dict.fromkeys(schedule))
    chunk_sizes = tuple(dict.fromkeys(loss_chunk)) if isinstance(loss_chunk, tuple) else (loss_chunk,)
    for tp, cp in itertools.product(divisors(gpus), context_parallel or divisors(gpus)):
        if gpus % (tp * cp):
            continue
        for pp in divisors(gpus // (tp * cp)):
            dp = gpus // (tp * cp * pp)
            # (under cp, selective is none: blockwise attention keeps no s² tensor; its rule says so to predict())
            kinds = RECOMPUTE if cp == 1 else tuple(k for k in RECOMPUTE if k != "selective")
            for vpp, zero, mbs, recompute, (ep, etp), name in itertools.product(
                    VIRTUAL_STAGES if pp > 1 else (1,), [0, 1] if dp * cp > 1 else [0], micro_batches, kinds,
                    expert_grids(inventory, tp * cp * dp), schedules if pp > 1 else schedules[:1]):
                if not runs_at(name, vpp) and len(schedules) > 1:
                    continue  # searched beside 1F1B: ZB-H1 at vpp 1 only, ZB-V at 2 (asked alone: refused)
                if zero and etp > 1:
                    continue  # the strategy refuses zero=1 with expert_tp > 1
                priced: set[Optional[int]] = set()  # the chunk sizes this layout's loss runs with, priced once each
                for chunk_size in chunk_sizes:
                    record = LayoutRecord(tp, cp, pp, vpp, dp, zero, mbs, 0, recompute,
                                          main_params=zero == 1 and precision == "bf16-true", ep=ep, expert_tp=etp,
                                          cp_comm=cp_comm if cp > 1 else "ring", schedule=name if pp > 1 else "1F1B",
                                          loss_chunk=chunk_size)
                    effective = loss_chunk_positions(record, inventory, seq_len // cp)
                    if effective in priced:
                        continue
                    priced.add(effective)
                    batch = global_batch * dp if per_rank_batch else global_batch
                    options = (inventory, seq_len, batch, hardware, precision, headroom, name, attention_dropout,
                               fits if calibrate else None, optimizer, state_floor)
                    _evaluate(record, *options)
                    records.append(record)
                    if memory_choices and record.bytes and not record.feasible:
                        if memory_choices_on is None:
                            records += traded(record, options)
                        elif record.recompute != "full":  # (nothing to trade under full recomputation)
                            candidates.append((record, options))
    for record, options in sorted(candidates, key=lambda c: c[0].bytes["total"])[:memory_choices_on or 0]:
        records += traded(record, options)
    feasible = sorted((r for r in records if r.feasible), key=lambda r: r.step_time["total"])
    return feasible + [r for r in records if not r.feasible]


def traded(record: LayoutRecord, options: tuple) -> list[LayoutRecord]:
    """``record`` (a layout too large for the GPU) with each of :func:`~.memory_choices.trades` that its rules allow,
    evaluated with ``options`` (:func:`_evaluate`'s arguments after the record); each says why in ``why``."""
    out = []
    mixture = options[0].experts is not None
    for modules, offload in trades(mixture):
        if memory_choice_rule(record.recompute, modules, offload, record.cp, options[0].eager_attention,
                              mixture) is not None:
            continue
        other = replace(record, modules=modules, offload=offload, feasible=False, reason=None, bytes={}, other={},
                        host={}, flops={}, collective_bytes={}, step_time={})
        _evaluate(other, *options)
        if other.feasible:
            cost = other.step_time.get("offload", 0.0)
            other.why = (f"{describe(other)}: {other.bytes['total'] / 1e9:.1f} GB where {record.recompute} alone needs "
                         f"{record.bytes['total'] / 1e9:.1f} GB" + (
                             "" if not offload else f", {other.host['moved_per_step'] / 1e9:.1f} GB each way per step"
                             + (f" adding {cost:.3f} s of host-link time" if cost else " hidden under the compute")))
        out.append(other)
    return out


def predict(inventory: ModelInventory, record: LayoutRecord, seq_len: int, global_batch: int, *,
            hardware: Hardware = Hardware(), precision: str = "bf16-mixed", headroom: float = 0.8,
            schedule: str = "1F1B", attention_dropout: bool = False, calibrate: bool = True,
            fits: Optional[dict[tuple, Any]] = None, optimizer: str = "adamw") -> LayoutRecord:
    """Fill in ``record`` (one layout: its ``tp``, ``pp``, ``vpp``, ``dp``, ``zero``, ``micro_batch``, ``recompute``,
    ``main_params``) as :func:`plan` does: its rules, bytes of its most loaded rank, FLOPs, traffic, step time.
    ``fits``: the probes' cache, shared between calls. Returns ``record``.

    Raises:
        ValueError: an unknown precision or optimizer.
    """
    _check(precision, optimizer)
    _evaluate(record, inventory, seq_len, global_batch, hardware, precision, headroom, schedule, attention_dropout,
              (fits if fits is not None else {}) if calibrate else None, optimizer)
    return record


def _check(precision: str, optimizer: str) -> None:
    if precision not in PARAMETER_BYTES:
        raise ValueError(f"precision={precision!r}: one of {sorted(PARAMETER_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: one of {sorted(OPTIMIZER_STATES)} (sgd: with momentum).")


def _spans_nodes(gpus_per_node: int, ranks: int) -> bool:
    return ranks > gpus_per_node


def _attention_call(record: LayoutRecord, shape: TransformerShape) -> float:
    """FLOPs of one core-attention call on a rank, forward and backward (``12·b·s²·h``, Eq. 7's share, over the rank's
    part): ``b`` sequences, ``h/t`` query width, ``s/c`` queries against ``s/c`` keys per block under the ring; the
    whole sequence over ``h/(t·c)`` under all-to-all context parallelism."""
    b, s, width = record.micro_batch, shape.s / record.cp, shape.h / record.tp
    if record.cp > 1 and record.cp_comm == "all_to_all":
        s, width = shape.s, width / record.cp
    return 12 * b * s * s * width


def _context_messages(record: LayoutRecord) -> int:
    """Messages one rank sends per layer and micro-batch in its context-parallel attention: the ring's key/value
    block to the next rank c − 1 times forward and, backward, the blocks and their gradients; all-to-all: q, k, v and
    the output forward, their gradients backward. A full recomputation's forward again."""
    forward, backward = (record.cp - 1, 2 * (record.cp - 1)) if record.cp_comm == "ring" else (4, 4)
    return forward * (2 if record.recompute == "full" else 1) + backward


def _context_bytes(inventory: ModelInventory, record: LayoutRecord, s: int, element: int) -> float:
    """Bytes one rank sends per layer and micro-batch in its context-parallel attention, forward and backward (the
    ring's key/value blocks and their gradients, or the all-to-alls: ``context_parallel.attention.bytes_per_layer``;
    a full recomputation's forward again); 0 without context parallelism."""
    if record.cp == 1:
        return 0.0
    from lightning_seqpar.context_parallel.attention import bytes_per_layer

    sent = bytes_per_layer(record.cp_comm, record.micro_batch, s, inventory.num_heads, inventory.num_kv_heads,
                           inventory.head_dim, record.tp, record.cp, element)
    forward, backward = (sum(sent[k].values()) for k in ("forward", "backward"))
    return forward * (2 if record.recompute == "full" else 1) + backward


def _evaluate(record: LayoutRecord, inventory: ModelInventory, s: int, global_batch: int, hardware: Hardware,
              precision: str, headroom: float, schedule: str, dropout: bool,
              fits: Optional[dict[tuple, Any]] = None, optimizer: str = "adamw",
              state_floor: bool = False) -> None:
    """Fill ``record``: the rules' verdict, then its peak bytes, FLOPs, traffic and step time, and whether it fits;
    ``state_floor``: not priced past its model state where that alone exceeds the GPU (:func:`plan`)."""
    record.reason = layout_rule(record, inventory, s, global_batch, hardware)
    if record.reason is None and record.pp > 1:
        record.reason = chunks_rule(schedule, record.vpp)
    if record.reason is not None:
        return
    name = resolve_schedule(schedule, record.vpp) if record.pp > 1 else "1F1B"
    record.schedule = name
    layout = stage_layout(inventory, record.pp, record.vpp, placement=stage_placement_of(name))
    if state_floor:
        floor, stage = max((_state(record, inventory, precision, optimizer, layout, rank).floor, rank)
                           for rank in range(record.pp))
        if floor > headroom * hardware.memory:
            record.state_floor, record.stage = floor, stage
            record.reason = (f"its model state alone needs {floor / 1e9:.1f} GB > {headroom:g} × "
                             f"{hardware.memory / 1e9:g} GB on stage {stage}")
            return
    moved = _peak_bytes(record, inventory, s, precision, dropout, fits, optimizer, layout)
    shape, executed = _flops(record, inventory, s, global_batch)
    traffic, held = _traffic(record, inventory, s, precision, hardware, layout)
    tp, pp, vpp, dp, b, m = record.tp, record.pp, record.vpp, record.dp, record.micro_batch, record.num_microbatches
    cp, local = record.cp, s // record.cp
    layers_per_rank, width, ranks = inventory.num_layers // pp, record.ep * record.expert_tp, tp * cp * pp * dp
    record.bubble = (pp - 1) / (vpp * m) if pp > 1 else 0.0
    if pp > 1 and splits_backward(name):
        # idle over compute; F : B : W = 1 : 2 − w : w, w the deferred weights' share of the backward's weight GEMMs
        # (Eq. 7's 2 : 4 split of the FLOPs, halved: 1 : 1 : 1 when every weight trains; LoRA's W is its adapters'),
        # and under full recomputation B runs the layer's forward again first (Eq. 8): 1 : 3 − w : w
        w, again = inventory.weight_gradient_share, 1.0 if record.recompute == "full" else 0.0
        idle = bubble_fraction(name, m, pp, costs=(1.0, 2.0 - w + again, w))
        record.bubble = idle / (1 - idle)
    attention = attention_flops(shape, global_batch, record.recompute)
    ffn = inventory.ffn_hidden_size
    # the elements this rank's optimizer updates: its trainable shards, a 1/(d·c) range of them under zero 1
    dense, experts = trained_elements(inventory, layout, record.stage, tp, record.ep, record.expert_tp)
    if record.zero:
        dense, experts = dense / (dp * cp), experts / max(1, tp * dp * cp // width)
    work = elementwise_work(record, inventory, s, precision, fits) if hardware.calibration is not None else None
    times = step_times(hardware, executed / ranks, attention / ranks,
                       (local * b, inventory.hidden_size, max(1, ffn // tp)), _attention_call(record, shape), traffic,
                       record.bubble,
                       optimizer_elements=dense + experts, elementwise=work)
    if optimizer == "muon":  # Newton-Schulz on the owned matrices, nominal; their pieces within the tp group
        ns, sent = muon_step_cost(held, tp, record.ep, record.expert_tp, dp * cp if record.zero else 1)
        times["newton_schulz"] = ns / (hardware.efficiency * hardware.peak_flops)
        times["muon_exchange"] = sent / hardware.intra_node_bandwidth
    compute = times["compute"]
    record.timing = "measured rates" if hardware.calibration is not None else "rough estimate"
    if record.offload:  # the host holds, at most, what the rank with the most layer-micro-batches in flight offloaded
        in_flight = max(sum(n * layout.sizes[layout.stages_of(rank)[c]] for c, n in enumerate(counts))
                        for rank in range(pp) for counts, _, _, _ in backward_moments(name, m, pp, vpp, rank))
        record.host, times["offload"] = host_traffic(moved, layers_per_rank, m, in_flight, compute,
                                                     hardware.host_bandwidth)
    times["total"] = sum(times.values())
    record.step_time = times
    budget = headroom * hardware.memory
    if record.host and record.host["held"] > hardware.host_memory:
        record.reason = (f"offloads {record.host['held'] / 1e9:.1f} GB > {hardware.host_memory / 1e9:g} GB of host memory "
                         f"per GPU")
        return
    if record.bytes["total"] > budget:
        record.reason = (f"needs {record.bytes['total'] / 1e9:.1f} GB > {headroom:g} × {hardware.memory / 1e9:g} GB on "
                         f"stage {record.stage}")
        return
    record.feasible = True


def _peak_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, dropout: bool,
                fits: Optional[dict[tuple, Any]], optimizer: str, layout: Any) -> float:
    """The most loaded pipeline rank's bytes at its step's peak into ``record`` (``stage``, ``bytes``, ``other``):
    each rank's model state and, at each moment one of its backwards starts (and in the optimizer's step), what its
    schedule holds in flight and what that moment makes. Returns the bytes one layer's offload moves per micro-batch
    (0 without offload)."""
    name = record.schedule
    tp, pp, vpp, dp, b, m = record.tp, record.pp, record.vpp, record.dp, record.micro_batch, record.num_microbatches
    cp, local = record.cp, s // record.cp  # a context-parallel rank's layers see s/c tokens
    element = activation_element_bytes(precision)
    per_layer = layer_activation_bytes(record, inventory, s, precision, dropout, fits)
    # What a layer's backward makes again or brings back: its kept bytes without recomputation and offload, less
    # with them. Of it, what the offload moves (the same layer's bytes with and without it).
    moved = recomputed = prefetched = 0.0
    if record.recompute != "none" or record.modules:
        whole = LayoutRecord(tp, cp, pp, vpp, dp, record.zero, b, m, "none", record.main_params, ep=record.ep,
                             expert_tp=record.expert_tp, loss_chunk=record.loss_chunk,
                             offload=record.offload, schedule=name)
        kept_whole = layer_activation_bytes(whole, inventory, s, precision, dropout, fits)
        recomputed = max(0.0, kept_whole - per_layer)
        if record.recompute == "selective":
            # the core attention's part is remade in its own backward, after the layer's MLP backward: its moment
            # prices it (attention_backward), not the layer's (not beside the MLP's inner gradients; docs/plan.md,
            # "What the peak's terms were measured against")
            plain = replace(record, modules=(), offload=())
            core = max(0.0, kept_whole - layer_activation_bytes(plain, inventory, s, precision, dropout, fits))
            recomputed = max(0.0, recomputed - core)
    if record.offload:
        moved = max(0.0, layer_activation_bytes(replace(record, offload=()), inventory, s, precision, dropout, fits) - per_layer)
        recomputed += offload_backward_bytes(moved, per_layer, inventory.num_layers // (pp * vpp),
                                             largest_offloaded_share(inventory, local, b, tp, record, element, dropout))
        prefetched = moved * (inventory.num_layers // (pp * vpp) > 1)
    first_saving = first_layer_saving(record, inventory, local, precision, fits)  # kept less by stage 0's first layer
    mlp_kept = mlp_kept_bytes(record, inventory, local, precision, fits)
    # Under a split backward no micro-batch keeps autocast's 16-bit weight copies (per_layer is without them), but a
    # chunk's forward holds its layers' copies in autocast's cache until its region ends, the loss's forward included.
    cached = cached_copy_bytes(inventory, record, precision) if fits is not None and inventory.config is not None else 0
    worst: tuple[float, int, dict[str, int], dict[str, int]] = (-1.0, 0, {}, {})
    parameter = PARAMETER_BYTES[precision]
    outside, prologue = outside_bytes(record, inventory, s, precision, element, fits)
    # Outside the layers, a forward keeps the stage input ([s/t, b, h]: what a pipeline stage received), the prologue
    # (mask, rotary tables, position ids) and the epilogue (final norm, head, loss). Under a pipeline every
    # chunk-forward keeps an input and a prologue of its own; only the last chunk an epilogue. Where the first layer
    # is fitted apart (frozen parameters), it holds its own input (none, or the layers' [s, b, h] copy of the
    # embedding's output that its checkpoint keeps), which the fitted outside leaves out.
    stage_input = element * local * b * inventory.hidden_size / tp
    apart = fits is not None and inventory.config is not None and first_layer_apart(inventory.training)
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
    largest = largest_layer_weight(inventory, tp, record.ep, record.expert_tp)
    if cp == 1:
        attention_backward = attention_backward_bytes(inventory, s, b, tp, precision, record.recompute)
        forward = forward_transient_bytes(inventory, s, b, tp, precision, record.recompute)
    else:
        attention_backward = context_transient_bytes(inventory, s, b, tp, cp, precision, True, record.cp_comm)
        forward = context_transient_bytes(inventory, s, b, tp, cp, precision, False, record.cp_comm)
    # a micro-batch past its B (a split backward): what its W reads, the split linears' inputs and output gradients
    w_held = weight_gradient_bytes(inventory, local, b, tp, True, element) if splits_backward(name) else 0.0
    mlp_w_held = weight_gradient_bytes(inventory, local, b, tp, True, element, ("mlp",)) if w_held else 0.0
    transients: dict[tuple[bool, bool], float] = {}
    for rank in range(pp):
        state = _state(record, inventory, precision, optimizer, layout, rank)
        stages = layout.stages_of(rank)
        # (`.grad` exists for trained parameters only: LoRA's frozen base makes none)
        accumulated = accumulation_bytes(state.trained, m, state.bucketed, record.zero == 0 and parameter < 4)
        # `.grad` a step's first backward has not made yet (where the buckets are not the gradients).
        unmade = state.gradients if not state.bucketed else (
            state.trained if record.zero == 0 and parameter < 4 else 0)
        # The step peaks at one of this rank's backwards (what its schedule holds in flight then, and what that
        # backward makes) or in the optimizer's step, once the activations are gone.
        opt = state.temporary  # the optimizer's step, after the backwards
        peak = (state.total + opt, state.gradients, 0.0, {"optimizer": opt})  # (total, gradients, activations, other)
        sizes = [layout.sizes[k] for k in stages]
        held_layers, final = sum(sizes), layout.num_stages - 1
        # what a micro-batch in flight keeps on each of this rank's chunks (read at every moment of every layout)
        chunk_kept = [sizes[c] * per_layer + (first_around - first_saving if stage == 0 else around)
                      + (after if stage == final else 0.0) for c, stage in enumerate(stages)]
        for counts, chunk, made, waiting in backward_moments(name, m, pp, vpp, rank):
            # the share of this rank's gradients that exist (a split backward makes a chunk's in its first W)
            share = sum(size for size, ok in zip(sizes, made) if ok) / held_layers
            accumulating = share > 0
            kept = sum(n * held for n, held in zip(counts, chunk_kept))
            kept += sum(n * size * w_held for n, size in zip(waiting, sizes))
            last = stages[chunk] == final
            # The explicit core attention's backward comes after the head's backward freed the epilogue and, when
            # it is recomputed, after its layer's MLP backward freed that half of the layer's kept bytes (kept
            # probabilities are the attention's own, and stay until it runs): its temporaries count beyond that.
            # Under a split backward the MLP's B leaves what its W reads in that half's place (a frozen MLP's W
            # reads nothing: LoRA frees the half).
            halved = record.recompute != "none" or bool(record.modules or record.offload)
            # Kept whole, a layer's MLP frees what it kept before the attention's backward too (its probed share).
            spent = max(0.0, (per_layer / 2 if halved else mlp_kept) - mlp_w_held) + (epilogue if last else 0.0)
            # Under a split backward, each of the chunk's layers through B holds what its W reads in place of what
            # it kept, more than that where it recomputes: by the chunk's first layer, all but one hold it.
            through = (sizes[chunk] - 1) * max(0.0, w_held - per_layer)
            if (last, accumulating) not in transients:  # (the rest of its arguments are the layout's)
                transients[last, accumulating] = backward_transient_bytes(
                    inventory, local, b, tp, element, gradient, last, accumulating, recomputed, largest=largest,
                    freed=epilogue, loss=loss_backward, expert_tp=record.expert_tp)
            moment = {"backward": through + max(transients[last, accumulating],
                                               attention_backward - spent + prefetched),
                      "accumulated_gradients": accumulated * share}
            # before a chunk's first backward (a split chunk's first W) its weights have no `.grad`; the buckets,
            # where they are the gradients, exist from the first step on
            gradients = state.gradients - round((1 - share) * unmade)
            total = state.total - state.gradients + gradients + kept + sum(moment.values())
            if total > peak[0]:
                peak = (total, gradients, kept, moment)
            if last:  # just before: the loss's forward, its logits (and their float32 copy) beside the softmax
                ahead = {"loss_forward": logits + loss_forward + cached * sizes[chunk],
                         "accumulated_gradients": moment["accumulated_gradients"]}
                total = state.total - state.gradients + gradients + kept + sum(ahead.values())
                if total > peak[0]:
                    peak = (total, gradients, kept, ahead)
            # The forward that filled this moment, its last layer's core attention at work: half that layer's own
            # kept bytes made (its attention's inputs, not its MLP's).
            ahead = {"forward": forward + cached * max(sizes),
                     "accumulated_gradients": moment["accumulated_gradients"]}
            filling = kept - per_layer / 2
            total = state.total - state.gradients + gradients + filling + sum(ahead.values())
            if pp > 1 and total > peak[0]:
                peak = (total, gradients, filling, ahead)
        if pp == 1:  # Lightning zeroes .grad after training_step: the last step's live through the forward
            # The head and loss not run yet; half the last layer's own kept bytes made, as above.
            kept = (layout.sizes[stages[0]] - 0.5) * per_layer - first_saving + outside - epilogue
            if state.total + kept + forward > peak[0]:
                peak = (state.total + kept + forward, state.gradients, kept, {"forward": forward})
        _, gradients, activations, other = peak
        parts = {k: int(v) for k, v in other.items() if v}
        split = dict(parameters=state.parameters, gradients=gradients, main_params=state.main_params,
                     optimizer=state.optimizer,
                     activations=int(never_negative("the activations", activations, record)), other=sum(parts.values()))
        split["total"] = sum(split.values())
        if split["total"] > worst[0]:
            worst = (split["total"], rank, split, parts)
    _, record.stage, record.bytes, record.other = worst
    return moved


def _state(record: LayoutRecord, inventory: ModelInventory, precision: str, optimizer: str, layout: Any,
           rank: int) -> StateBytes:
    """Pipeline rank ``rank``'s model-state bytes under ``record`` (gradients reduced, and ZeRO sharded, over the
    ``d·c`` ranks of the data group)."""
    return state_bytes(inventory, record.tp, record.pp, record.dp * record.cp, pipeline_rank=rank, vpp=record.vpp,
                       zero=record.zero, precision=precision, main_params=record.main_params, optimizer=optimizer,
                       ep=record.ep, placement=layout.placement, expert_tp=record.expert_tp)


def _flops(record: LayoutRecord, inventory: ModelInventory, s: int, global_batch: int) -> tuple[TransformerShape, float]:
    """Model and hardware FLOPs per step into ``record.flops`` (Eq. 7, Eq. 8, with recomputation by module and the
    loss's chunks made again, less the weight-gradient GEMMs of frozen weights); returns the shape they were counted
    on and the hardware FLOPs."""
    positions = loss_chunk_positions(record, inventory, s // record.cp)
    shape = TransformerShape(s=s, b=1, h=inventory.hidden_size, a=inventory.num_heads, L=inventory.num_layers,
                             v=inventory.vocab_size, ffn_hidden_size=inventory.ffn_hidden_size,
                             num_kv_heads=inventory.num_kv_heads, gated_mlp=inventory.gated_mlp)
    model = model_flops_per_iteration(shape, global_batch)
    executed = hardware_flops_per_iteration(shape, global_batch, record.recompute)
    if "mlp" in record.modules:  # one more MLP forward per layer
        executed += inventory.num_layers * mlp_forward_flops(shape, global_batch)
    if positions is not None:  # the loss in chunks: each chunk's logits made again in backward, the head's GEMM again
        executed += 2 * global_batch * s * inventory.hidden_size * inventory.vocab_size
    executed -= 2 * global_batch * s * inventory.frozen_gemm_elements  # frozen weights: no weight-gradient GEMM
    record.flops = {"model": model, "hardware": executed}
    return shape, executed


def _traffic(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, hardware: Hardware,
             layout: Any) -> tuple[dict[str, Traffic], list]:
    """Bytes each rank sends per step by kind into ``record.collective_bytes``, and each kind's :class:`Traffic` (how
    many collectives, of which kind, over how many ranks, across nodes or not); also the entries the most loaded
    rank holds (:func:`~.state.held_entries`)."""
    tp, pp, vpp, dp, b, m = record.tp, record.pp, record.vpp, record.dp, record.micro_batch, record.num_microbatches
    cp, local = record.cp, s // record.cp
    element = activation_element_bytes(precision)
    sbh = element * local * b * inventory.hidden_size
    layers_per_rank = inventory.num_layers // pp
    # g/ḡ pairs per layer: the attention's, and the MLP's (a mixture's shared expert; its routed experts use none)
    pairs = 1 + (inventory.experts is None or inventory.experts.shared_ffn > 0)
    collectives = 4 * pairs + (2 * pairs if record.recompute == "full" else 0)
    held = held_entries(inventory, layout, record.stage)
    width = record.ep * record.expert_tp  # ranks splitting each expert tensor
    dense, experts = trained_elements(inventory, layout, record.stage, tp, record.ep, record.expert_tp)
    expert_gradients, gradient_bytes = 4 * experts, 4 * dense
    record.collective_bytes = {
        "tensor": layers_per_rank * m * collectives * ring_bytes("all_gather", sbh, tp),
        # reduced in float32: dense gradients over d, the experts' over their edp = t·d/(e·etp) replicas
        "data": ring_bytes("all_reduce", gradient_bytes, dp * cp) + ring_bytes("all_reduce", expert_gradients,
                                                                              tp * dp * cp // width),
        "pipeline": (2 * m * vpp * sbh / tp) if pp > 1 else 0.0,
        "expert": m * all_to_all_bytes(inventory, record, local, element, held),
        "context": layers_per_rank * m * _context_bytes(inventory, record, s, element),
    }
    ranks = tp * cp * pp * dp
    moe_layers = layers_per_rank if inventory.experts is not None else 0
    spans = functools.partial(_spans_nodes, hardware.gpus_per_node)
    collectives_of = {
        "tensor": (layers_per_rank * m * collectives, ("all_gather", "reduce_scatter"), tp, False),
        # one all-reduce per gradient bucket (dense and expert buckets apart); under zero 1 a reduce-scatter of the
        # gradients and an all-gather of the parameters per bucket, each half the volume, each at its own rate (gloo
        # on 2 CPU processes: a reduce-scatter at a third of the all-reduce's bandwidth)
        "data": ((1 + (record.zero > 0)) * (math.ceil(gradient_bytes / DEFAULT_BUCKET_BYTES)
                                           + math.ceil(expert_gradients / DEFAULT_BUCKET_BYTES)),
                 ("reduce_scatter", "all_gather") if record.zero else ("all_reduce",), dp * cp, spans(ranks)),
        # (the nominal model prices every stage boundary at the network's rate)
        "pipeline": (2 * m * vpp, ("send_recv",), 2, hardware.calibration is None or spans(ranks)),
        # the dropless dispatch's split counts, its rows and the combine's forward (again under full recomputation),
        # the rows' and the combine's backward (moe/dispatch.py)
        "expert": (moe_layers * m * (8 if record.recompute == "full" else 5), ("all_to_all",), width, spans(tp * width)),
        "context": (layers_per_rank * m * _context_messages(record), ("all_to_all",) if record.cp_comm == "all_to_all"
                    else ("send_recv",), cp, spans(tp * cp)),
    }
    traffic = {kind: Traffic(record.collective_bytes[kind], count if record.collective_bytes[kind] else 0, collective,
                             group, inter) for kind, (count, collective, group, inter) in collectives_of.items()}
    return traffic, held
