"""Every layout of a model on N GPUs, feasible or not and why, ranked by predicted step time.

:func:`plan` enumerates tensor, pipeline (with virtual stages) and data parallel sizes, ZeRO, micro-batch size and
recomputation; checks each against the strategy's rules (the reason of each rejection in the field's words); for each
feasible one predicts, per pipeline rank, the model-state bytes (exact: :mod:`.pricing.state`), the activations of
the micro-batches in flight (a layer's bytes measured on small copies of the model and scaled,
:mod:`.measuring.probe`; Table 2's model, :mod:`.pricing.activations`, where the model cannot be probed), the
communication buffers, the FLOPs, the bytes per collective kind and the step time (:mod:`.pricing.cost`); a layout fits
when its most loaded rank stays within ``headroom × memory`` (0.8 by default: Fujii et al. found no run under 80 % of
device memory that ran out).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace
from typing import Any, Optional, Union

from lightning_seqpar.layout import Layout
from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.flops import hardware_flops_per_iteration, mlp_forward_flops, model_flops_per_iteration
from lightning_seqpar.optim.grad_buckets import DEFAULT_BUCKET_BYTES
from lightning_seqpar.pipeline_parallel.schedules import (
    bubble_fraction, resolve_schedule, runs_at, splits_backward, stage_placement_of,
)
from lightning_seqpar.plan.measuring.fits import ProbedMeasurements
from lightning_seqpar.plan.pricing.cost import Hardware, Traffic, attention_flops, ring_bytes, step_times
from lightning_seqpar.plan.pricing.experts import all_to_all_bytes, expert_grids
from lightning_seqpar.plan.pricing.kept import activation_element_bytes, elementwise_work, loss_chunk_positions
from lightning_seqpar.plan.pricing.layout_record import LayoutRecord
from lightning_seqpar.plan.pricing.measurements import Measurements
from lightning_seqpar.plan.pricing.memory_choices import describe, host_traffic, memory_choice_rule, trades
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.moments import backward_moments, chunks_rule
from lightning_seqpar.plan.pricing.muon_cost import muon_step_cost
from lightning_seqpar.plan.pricing.peak import peak_bytes, rank_state
from lightning_seqpar.plan.pricing.rules import divisors, layout_rule
from lightning_seqpar.plan.pricing.state import (
    OPTIMIZER_STATES, PARAMETER_BYTES, held_entries, stage_layout, trained_elements,
)

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
            (:mod:`~lightning_seqpar.plan.measuring.probe`; a Hugging Face model), else the analytic model
            (:mod:`~lightning_seqpar.plan.pricing.activations`).
        fits: the probes' cache, shared between calls (its own when not given), for any models: a fit is keyed by
            the model's config (:attr:`~..measuring.inventory.ModelInventory.probe_key`) and the layout.
        optimizer: ``adamw`` (the default), ``adam``, ``sgd`` (with momentum): its state per parameter element;
            ``muon`` (``optim.name=muon``): momentum on the layers' matrices, AdamW on the rest, its Newton–Schulz
            FLOPs and gather traffic in the step (:mod:`..pricing.muon_cost`).
        per_rank_batch: ``global_batch`` is per data-parallel rank (a Lightning loader's batch): each layout's global
            batch is ``global_batch × dp``.
        context_parallel: the context-parallel sizes c to consider (``None``: every divisor of the GPUs), with
            ``cp_comm`` (``ring`` or ``all_to_all``).
        memory_choices: a layout too large for the GPU is tried again with recomputation by module and activation
            offload (:func:`~..pricing.memory_choices.trades`); those that fit compete with the rest by step time (the
            offload's host-link time and the MLP's recomputed FLOPs counted), their ``why`` saying what they replaced.
        memory_choices_on: with ``memory_choices``, try them on the ``memory_choices_on`` smallest layouts too large
            for the GPU that allow them (not under full recomputation) instead of on every one: whether memory
            choices make anything fit, at the probes of a few layouts (the command line's hint when nothing fits).
        loss_chunk: the strategy's ``loss_chunk`` (positions of the loss's logits at a time; ``None``: whole), each
            record's (:attr:`LayoutRecord.loss_chunk`); or several to search (``(4096, None)``): a layout is priced
            once per value that computes its loss differently (none of them past its positions per rank: once).
        state_floor: a layout whose model state alone exceeds ``headroom × hardware.memory`` is rejected without
            pricing its activations (its record's :attr:`~..pricing.layout_record.LayoutRecord.state_floor`): whether
            anything fits, and what fits, at the probes of those whose state leaves room (the command line's hints).

    Raises:
        ValueError: ``gpus``, ``seq_len`` or ``global_batch`` below 1, or an unknown precision or optimizer.
    """
    if gpus < 1 or seq_len < 1 or global_batch < 1:
        raise ValueError(f"gpus, seq_len and global_batch must be >= 1; got {gpus}, {seq_len}, {global_batch}.")
    _check(precision, optimizer)
    records = []
    candidates: list[tuple[LayoutRecord, tuple]] = []  # too large, to trade on after all are priced
    measured = ProbedMeasurements({} if fits is None else fits) if calibrate else None
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
                    layout = Layout(tp=tp, cp=cp, pp=pp, ep=ep, expert_tp=etp, virtual_stages=vpp,
                                    schedule=name if pp > 1 else "1F1B", cp_comm=cp_comm if cp > 1 else "ring",
                                    zero=zero, fp32_main_params=zero == 1 and precision == "bf16-true",
                                    loss_chunk=chunk_size, recompute=recompute)
                    record = LayoutRecord(layout, dp, mbs)
                    effective = loss_chunk_positions(record, inventory, seq_len // cp)
                    if effective in priced:
                        continue
                    priced.add(effective)
                    batch = global_batch * dp if per_rank_batch else global_batch
                    options = (inventory, seq_len, batch, hardware, precision, headroom, name, attention_dropout,
                               measured, optimizer, state_floor)
                    _evaluate(record, *options)
                    records.append(record)
                    if memory_choices and record.bytes and not record.feasible:
                        if memory_choices_on is None:
                            records += traded(record, options)
                        elif record.layout.recompute != "full":  # (nothing to trade under full recomputation)
                            candidates.append((record, options))
    for record, options in sorted(candidates, key=lambda c: c[0].bytes["total"])[:memory_choices_on or 0]:
        records += traded(record, options)
    feasible = sorted((r for r in records if r.feasible), key=lambda r: r.step_time["total"])
    return feasible + [r for r in records if not r.feasible]


def traded(record: LayoutRecord, options: tuple) -> list[LayoutRecord]:
    """``record`` (a layout too large for the GPU) with each of :func:`~..pricing.memory_choices.trades` that its rules
    allow, evaluated with ``options`` (:func:`_evaluate`'s arguments after the record); each says why in ``why``."""
    out = []
    mixture = options[0].experts is not None
    for modules, offload in trades(mixture):
        if memory_choice_rule(record.layout.recompute, modules, offload, record.layout.cp, options[0].eager_attention,
                              mixture) is not None:
            continue
        other = replace(record, layout=record.layout.replace(recompute_modules=modules, offload=offload),
                        feasible=False, reason=None, bytes={}, other={}, host={}, flops={}, collective_bytes={},
                        step_time={})
        _evaluate(other, *options)
        if other.feasible:
            cost = other.step_time.get("offload", 0.0)
            other.why = (f"{describe(other)}: {other.bytes['total'] / 1e9:.1f} GB where {record.layout.recompute} "
                         f"alone needs {record.bytes['total'] / 1e9:.1f} GB" + (
                             "" if not offload else f", {other.host['moved_per_step'] / 1e9:.1f} GB each way per step"
                             + (f" adding {cost:.3f} s of host-link time" if cost else " hidden under the compute")))
        out.append(other)
    return out


def predict(inventory: ModelInventory, record: LayoutRecord, seq_len: int, global_batch: int, *,
            hardware: Hardware = Hardware(), precision: str = "bf16-mixed", headroom: float = 0.8,
            schedule: Optional[str] = None, attention_dropout: bool = False, calibrate: bool = True,
            fits: Optional[dict[tuple, Any]] = None, optimizer: str = "adamw") -> LayoutRecord:
    """Fill in ``record`` (its :class:`~lightning_seqpar.Layout`, ``dp`` and ``micro_batch``) as :func:`plan` does:
    its rules, bytes of its most loaded rank, FLOPs, traffic, step time. ``schedule``: the layout's own when
    ``None``. ``fits``: the probes' cache, shared between calls. Returns ``record``.

    Raises:
        ValueError: an unknown precision or optimizer.
    """
    _check(precision, optimizer)
    schedule = schedule or record.layout.schedule
    _evaluate(record, inventory, seq_len, global_batch, hardware, precision, headroom, schedule, attention_dropout,
              ProbedMeasurements({} if fits is None else fits) if calibrate else None, optimizer)
    return record


def _check(precision: str, optimizer: str) -> None:
    if precision not in PARAMETER_BYTES:
        raise ValueError(f"precision={precision!r}: one of {sorted(PARAMETER_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: one of {sorted(OPTIMIZER_STATES)} (sgd: with momentum).")


def _split_calls(inventory: ModelInventory, schedule: str, m: int) -> int:
    """Split projection backwards per layer and step under ``schedule`` (``1F1B`` without a pipeline): each deferred
    projection once per micro-batch, a LoRA adapter's two products twice (none where the backward is not split)."""
    if not splits_backward(schedule):
        return 0
    return m * sum(2 if p.rank else 1 for p in inventory.split_projections)


def _spans_nodes(gpus_per_node: int, ranks: int) -> bool:
    return ranks > gpus_per_node


def _attention_call(record: LayoutRecord, shape: TransformerShape) -> float:
    """FLOPs of one core-attention call on a rank, forward and backward (``12·b·s²·h``, Eq. 7's share, over the rank's
    part): ``b`` sequences, ``h/t`` query width, ``s/c`` queries against ``s/c`` keys per block under the ring; the
    whole sequence over ``h/(t·c)`` under all-to-all context parallelism."""
    b, s, width = record.micro_batch, shape.s / record.layout.cp, shape.h / record.layout.tp
    if record.layout.cp > 1 and record.layout.cp_comm == "all_to_all":
        s, width = shape.s, width / record.layout.cp
    return 12 * b * s * s * width


def _context_messages(record: LayoutRecord) -> int:
    """Messages one rank sends per layer and micro-batch in its context-parallel attention: the ring's key/value
    block to the next rank c − 1 times forward and, backward, the blocks and their gradients; all-to-all: q, k, v and
    the output forward, their gradients backward. A full recomputation's forward again."""
    lay = record.layout
    forward, backward = (lay.cp - 1, 2 * (lay.cp - 1)) if lay.cp_comm == "ring" else (4, 4)
    return forward * (2 if lay.recompute == "full" else 1) + backward


def _context_bytes(inventory: ModelInventory, record: LayoutRecord, s: int, element: int) -> float:
    """Bytes one rank sends per layer and micro-batch in its context-parallel attention, forward and backward (the
    ring's key/value blocks and their gradients, or the all-to-alls: ``context_parallel.attention.bytes_per_layer``;
    a full recomputation's forward again); 0 without context parallelism."""
    if record.layout.cp == 1:
        return 0.0
    from lightning_seqpar.context_parallel.attention import bytes_per_layer

    sent = bytes_per_layer(record.layout.cp_comm, record.micro_batch, s, inventory.num_heads, inventory.num_kv_heads,
                           inventory.head_dim, record.layout.tp, record.layout.cp, element)
    forward, backward = (sum(sent[k].values()) for k in ("forward", "backward"))
    return forward * (2 if record.layout.recompute == "full" else 1) + backward


def _evaluate(record: LayoutRecord, inventory: ModelInventory, s: int, global_batch: int, hardware: Hardware,
              precision: str, headroom: float, schedule: str, dropout: bool,
              measured: Optional[Measurements] = None, optimizer: str = "adamw",
              state_floor: bool = False) -> None:
    """Fill ``record``: the rules' verdict, then its peak bytes, FLOPs, traffic and step time, and whether it fits;
    ``state_floor``: not priced past its model state where that alone exceeds the GPU (:func:`plan`)."""
    record.reason = layout_rule(record, inventory, s, global_batch, hardware)
    if record.reason is None and record.layout.pp > 1:
        record.reason = chunks_rule(schedule, record.layout.virtual_stages)
    if record.reason is not None:
        return
    name = resolve_schedule(schedule, record.layout.virtual_stages) if record.layout.pp > 1 else "1F1B"
    record.layout = record.layout.replace(schedule=name)
    layout = stage_layout(inventory, record.layout.pp, record.layout.virtual_stages, placement=stage_placement_of(name))
    if state_floor:
        floor, stage = max((rank_state(record, inventory, precision, optimizer, layout, rank).floor, rank)
                           for rank in range(record.layout.pp))
        if floor > headroom * hardware.memory:
            record.state_floor, record.stage = floor, stage
            record.reason = (f"its model state alone needs {floor / 1e9:.1f} GB > {headroom:g} × "
                             f"{hardware.memory / 1e9:g} GB on stage {stage}")
            return
    moved = peak_bytes(record, inventory, s, precision, dropout, measured, optimizer, layout)
    shape, executed = _flops(record, inventory, s, global_batch)
    traffic, held = _traffic(record, inventory, s, precision, hardware, layout)
    lay, dp, b = record.layout, record.dp, record.micro_batch
    tp, pp, vpp, m, cp, local = lay.tp, lay.pp, lay.virtual_stages, lay.num_microbatches, lay.cp, s // lay.cp
    layers_per_rank, width, ranks = inventory.num_layers // pp, lay.ep * lay.expert_tp, tp * cp * pp * dp
    record.bubble = (pp - 1) / (vpp * m) if pp > 1 else 0.0
    if pp > 1 and splits_backward(name):
        # idle over compute; F : B : W = 1 : 2 − w : w, w the deferred weights' share of the backward's weight GEMMs
        # (Eq. 7's 2 : 4 split of the FLOPs, halved: 1 : 1 : 1 when every weight trains; LoRA's W is its adapters'),
        # and under full recomputation B runs the layer's forward again first (Eq. 8): 1 : 3 − w : w
        w, again = inventory.weight_gradient_share, 1.0 if lay.recompute == "full" else 0.0
        idle = bubble_fraction(name, m, pp, costs=(1.0, 2.0 - w + again, w))
        record.bubble = idle / (1 - idle)
    attention = attention_flops(shape, global_batch, lay.recompute)
    ffn = inventory.ffn_hidden_size
    # the elements this rank's optimizer updates: its trainable shards, a 1/(d·c) range of them under zero 1
    dense, experts = trained_elements(inventory, layout, record.stage, tp, lay.ep, lay.expert_tp)
    if lay.zero:
        dense, experts = dense / (dp * cp), experts / max(1, tp * dp * cp // width)
    work = elementwise_work(record, inventory, s, precision, measured) if hardware.calibration is not None else None
    times = step_times(hardware, executed / ranks, attention / ranks,
                       (local * b, inventory.hidden_size, max(1, ffn // tp)), _attention_call(record, shape), traffic,
                       record.bubble, optimizer_elements=dense + experts, elementwise=work,
                       split_projections=_split_calls(inventory, name, m) * layers_per_rank)
    if optimizer == "muon":  # Newton-Schulz on the owned matrices, nominal; their pieces within the tp group
        ns, sent = muon_step_cost(held, tp, lay.ep, lay.expert_tp, dp * cp if lay.zero else 1)
        times["newton_schulz"] = ns / (hardware.efficiency * hardware.peak_flops)
        times["muon_exchange"] = sent / hardware.intra_node_bandwidth
    compute = times["compute"]
    record.timing = "measured rates" if hardware.calibration is not None else "rough estimate"
    if lay.offload:  # the host holds, at most, what the rank with the most layer-micro-batches in flight offloaded
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


def _flops(record: LayoutRecord, inventory: ModelInventory, s: int, global_batch: int) -> tuple[TransformerShape, float]:
    """Model and hardware FLOPs per step into ``record.flops`` (Eq. 7, Eq. 8, with recomputation by module and the
    loss's chunks made again, less the weight-gradient GEMMs of frozen weights); returns the shape they were counted
    on and the hardware FLOPs."""
    positions = loss_chunk_positions(record, inventory, s // record.layout.cp)
    shape = TransformerShape(s=s, b=1, h=inventory.hidden_size, a=inventory.num_heads, L=inventory.num_layers,
                             v=inventory.vocab_size, ffn_hidden_size=inventory.ffn_hidden_size,
                             num_kv_heads=inventory.num_kv_heads, gated_mlp=inventory.gated_mlp)
    model = model_flops_per_iteration(shape, global_batch)
    executed = hardware_flops_per_iteration(shape, global_batch, record.layout.recompute)
    if "mlp" in record.layout.recompute_modules:  # one more MLP forward per layer
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
    rank holds (:func:`~..pricing.state.held_entries`)."""
    lay, dp, b = record.layout, record.dp, record.micro_batch
    tp, pp, vpp, m, cp, local = lay.tp, lay.pp, lay.virtual_stages, lay.num_microbatches, lay.cp, s // lay.cp
    element = activation_element_bytes(precision)
    sbh = element * local * b * inventory.hidden_size
    layers_per_rank = inventory.num_layers // pp
    # g/ḡ pairs per layer: the attention's, and the MLP's (a mixture's shared expert; its routed experts use none)
    pairs = 1 + (inventory.experts is None or inventory.experts.shared_ffn > 0)
    collectives = 4 * pairs + (2 * pairs if lay.recompute == "full" else 0)
    held = held_entries(inventory, layout, record.stage)
    width = lay.ep * lay.expert_tp  # ranks splitting each expert tensor
    dense, experts = trained_elements(inventory, layout, record.stage, tp, lay.ep, lay.expert_tp)
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
        "data": ((1 + (lay.zero > 0)) * (math.ceil(gradient_bytes / DEFAULT_BUCKET_BYTES)
                                         + math.ceil(expert_gradients / DEFAULT_BUCKET_BYTES)),
                 ("reduce_scatter", "all_gather") if lay.zero else ("all_reduce",), dp * cp, spans(ranks)),
        # (the nominal model prices every stage boundary at the network's rate)
        "pipeline": (2 * m * vpp, ("send_recv",), 2, hardware.calibration is None or spans(ranks)),
        # the dropless dispatch's split counts, its rows and the combine's forward (again under full recomputation),
        # the rows' and the combine's backward (moe/dispatch.py)
        "expert": (moe_layers * m * (8 if lay.recompute == "full" else 5), ("all_to_all",), width, spans(tp * width)),
        "context": (layers_per_rank * m * _context_messages(record),
                    ("all_to_all",) if lay.cp_comm == "all_to_all" else ("send_recv",), cp, spans(tp * cp)),
    }
    traffic = {kind: Traffic(record.collective_bytes[kind], count if record.collective_bytes[kind] else 0, collective,
                             group, inter) for kind, (count, collective, group, inter) in collectives_of.items()}
    return traffic, held
