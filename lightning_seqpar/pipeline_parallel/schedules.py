"""Pipeline schedules as per-rank action lists: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV.

An action is a forward (F) or a backward of one model chunk on one micro-batch; zero-bubble schedules split the
backward into B (the input gradient, which the previous stage waits for) and W (the weight gradient, which nothing
waits for: :mod:`lightning_seqpar.tensor_parallel.weight_gradients`). The executor runs a
rank's list in order; its data dependencies must never form a cycle across ranks (checked by
:func:`simulate`, which also counts the micro-batches in flight), and the transfers between the
actions must not deadlock under NCCL's rules (:mod:`.comm_plan`, checked by :mod:`.nccl_model`).

Sources: GPipe (Huang et al. 2019); 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al.
2021 §2.2, Megatron-LM ``schedules.py``), the schedules of Korthikanti et al. 2022 §6; ZB-H1 (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024, §3.1), ZB-V (§4) and DualPipeV (DeepSeek-V3 §3.2.1), the last two on the V
placement of :mod:`~lightning_seqpar.pipeline_parallel.layout`; the zero-bubble lists are built in
:mod:`.zero_bubble`.
"""

from __future__ import annotations

import functools
from typing import Iterator, Literal, Optional

from lightning_seqpar.pipeline_parallel.actions import Action
from lightning_seqpar.pipeline_parallel.layout import StagePlacement, stage_of_chunk
from lightning_seqpar.pipeline_parallel.zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["Action", "SCHEDULES", "SPLIT_BACKWARD", "V_SHAPED", "SEARCHED_SCHEDULES", "ScheduleName", "action_times",
           "bubble_fraction", "build_schedule", "chunks_per_rank", "check_microbatches", "dualpipe_v",
           "interleaved_one_f_one_b", "interleaved_warmup", "gpipe", "least_microbatches", "one_f_one_b",
           "stage_placement_of", "resolve_schedule", "runs_at", "simulate", "splits_backward", "trace_bubble_fraction",
           "zb_h1", "zb_v"]

SCHEDULES = ("1F1B", "gpipe", "interleaved_1F1B", "ZB-H1", "ZB-V", "DualPipeV")
ScheduleName = Literal["1F1B", "gpipe", "interleaved_1F1B", "ZB-H1", "ZB-V", "DualPipeV"]
SPLIT_BACKWARD = ("ZB-H1", "ZB-V", "DualPipeV")
"""The schedules whose backward is B then W (the parallel linears' weight gradients deferred to W)."""
V_SHAPED = ("ZB-V", "DualPipeV")
"""The schedules that run two model chunks per rank in the V placement (rank r: stages r and 2p − 1 − r)."""
SEARCHED_SCHEDULES = ("1F1B", "ZB-H1", "ZB-V", "DualPipeV")
"""The schedules a layout search prices (the planner, ``AutoLayout``): 1F1B (interleaved where vpp > 1), ZB-H1
(Qi et al. 2024: the backward split into B and W, one chunk per rank), ZB-V (two chunks per rank in a V, at
vpp 2 only) and DualPipeV (ZB-V's placement, from m = 2p; its pairs run one after the other here, so it idles as ZB-V
does; it holds one chunk micro-batch more but fewer waiting for their W, which can fit where ZB-V does not)."""


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` runs each backward as B then W (the parallel linears' weight gradients deferred to W):
    ZB-H1, ZB-V and DualPipeV (:data:`SPLIT_BACKWARD`)."""
    return schedule in SPLIT_BACKWARD


def stage_placement_of(schedule: str) -> StagePlacement:
    """The stage placement ``schedule`` runs on: ``"V"`` for ZB-V and DualPipeV, else ``"loop"``."""
    return "V" if schedule in V_SHAPED else "loop"


def runs_at(schedule: str, virtual_stages: int) -> bool:
    """Whether the split schedules run with ``virtual_stages`` chunks per rank: ZB-H1 with one, ZB-V with two (the
    others: any their :func:`resolve_schedule` accepts)."""
    if schedule in V_SHAPED:
        return virtual_stages == 2
    return virtual_stages == 1 if splits_backward(schedule) else True


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    """v as the layout builds it: 2 for a V-shaped schedule (whose ``virtual_stages`` may be left at 1), else
    ``virtual_stages``."""
    return 2 if schedule in V_SHAPED else virtual_stages


def resolve_schedule(schedule: str, virtual_stages: int) -> ScheduleName:
    """Canonical schedule name; ``"1F1B"`` with ``virtual_stages > 1`` is the interleaved schedule.

    Raises:
        ValueError: unknown name, ``virtual_stages < 1``, GPipe or ZB-H1 with several chunks, the interleaved
            schedule with one chunk, or ZB-V with other than two (1, the default, stands for its two).
    """
    names = {s.lower(): s for s in SCHEDULES} | {"interleaved": "interleaved_1F1B", "zbh1": "ZB-H1", "zbv": "ZB-V",
                                                "dualpipe_v": "DualPipeV", "dualpipe-v": "DualPipeV"}
    if not isinstance(schedule, str) or schedule.lower() not in names:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}.")
    name = names[schedule.lower()]
    if name == "1F1B" and virtual_stages > 1:
        name = "interleaved_1F1B"
    if name in V_SHAPED and virtual_stages > 2:
        raise ValueError(f"{name} places two model chunks per rank in a V; got virtual_stages={virtual_stages}. Leave "
                         f"virtual_stages at 1 or set it to 2.")
    if splits_backward(name) and name not in V_SHAPED and virtual_stages > 1:
        raise ValueError(f"{name} runs one model chunk per rank; got virtual_stages={virtual_stages}. Use "
                         f"virtual_stages=1.")
    if name == "gpipe" and virtual_stages > 1:
        raise ValueError(f"GPipe runs one model chunk per rank; got virtual_stages={virtual_stages}. "
                         f"Use schedule='1F1B' for the interleaved schedule.")
    if name == "interleaved_1F1B" and virtual_stages < 2:
        raise ValueError("The interleaved 1F1B schedule needs virtual_stages >= 2 model chunks per rank.")
    return name


def least_microbatches(schedule: ScheduleName, pp: int) -> int:
    """The fewest micro-batches ``schedule`` runs at ``pp`` ranks, the default m: ``2·pp`` for DualPipeV, else ``pp``."""
    return 2 * pp if schedule == "DualPipeV" else pp


def check_microbatches(num_microbatches: int, pp: int, schedule: ScheduleName) -> None:
    """Raise ``ValueError`` unless ``num_microbatches`` (m) suits the schedule.

    Every schedule needs ``m >= p`` (fewer micro-batches than stages leaves stages idle for the whole
    step); the interleaved schedule also needs ``m`` divisible by ``p``, since it moves through the
    chunks in groups of ``p`` micro-batches (Megatron-LM's requirement); DualPipeV needs ``m >= 2p`` (DeepSeek's).
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}.")
    if schedule == "DualPipeV" and num_microbatches < 2 * pp:
        raise ValueError(
            f"num_microbatches={num_microbatches} is smaller than 2·pp={2 * pp}: DualPipeV's warm-up sends 2·pp "
            f"micro-batches through the first chunk of rank 0. Use num_microbatches >= {2 * pp}."
        )
    if num_microbatches < pp:
        raise ValueError(
            f"num_microbatches={num_microbatches} is smaller than pp={pp}: the {schedule} schedule needs at least "
            f"one micro-batch per pipeline stage. Use num_microbatches >= {pp} (more shrinks the bubble)."
        )
    if schedule == "interleaved_1F1B" and num_microbatches % pp:
        raise ValueError(
            f"The interleaved schedule needs num_microbatches divisible by pp; got {num_microbatches} with pp={pp}. "
            f"Use a multiple of {pp}."
        )


def gpipe(m: int, p: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: every rank holds the activations of all m micro-batches."""
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(m: int, p: int, rank: int) -> list[Action]:
    """1F1B: ``p - rank - 1`` warm-up forwards, then one forward / one backward; at most ``p - rank``
    micro-batches in flight on ``rank``."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return actions + [Action("B", 0, i) for i in range(m - warmup, m)]


def interleaved_warmup(m: int, p: int, v: int, rank: int) -> int:
    """Forwards before the interleaved schedule's steady state on ``rank`` (Megatron-LM's count). With a single group
    of p micro-batches every forward runs first, as Megatron-LM does: the steady state's paired transfers
    (:mod:`~lightning_seqpar.pipeline_parallel.comm_plan`) would otherwise wait on each other around the ring."""
    total = m * v
    return total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)


def interleaved_one_f_one_b(m: int, p: int, v: int, rank: int) -> list[Action]:
    """Interleaved 1F1B with ``v`` chunks per rank: micro-batches advance through the chunks in groups
    of p; the bubble shrinks by v (Narayanan et al. 2021 Eq. 2, Megatron-LM
    ``forward_backward_pipelining_with_interleaving``)."""
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action("F", (k // p) % v, microbatch(k))

    def backward(k: int) -> Action:
        return Action("B", v - 1 - (k // p) % v, microbatch(k))

    warmup = interleaved_warmup(m, p, v, rank)
    actions = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    return actions + [backward(k) for k in range(total - warmup, total)]


def build_schedule(schedule: ScheduleName, m: int, p: int, v: int, rank: int, forward_only: bool = False) -> list[Action]:
    """The ordered actions of pipeline rank ``rank``; ``forward_only`` keeps the forwards (evaluation)."""
    if schedule == "gpipe":
        actions = gpipe(m, p, rank)
    elif schedule == "ZB-H1":
        actions = zb_h1(m, p, rank)
    elif schedule == "ZB-V":
        actions = zb_v(m, p, rank)
    elif schedule == "DualPipeV":
        actions = dualpipe_v(m, p, rank)
    elif schedule == "1F1B":
        actions = one_f_one_b(m, p, rank)
    else:
        actions = interleaved_one_f_one_b(m, p, v, rank)
    return [a for a in actions if a.kind == "F"] if forward_only else actions


def _needs(action: Action, stage: int, stages: int) -> Optional[tuple[str, int, int]]:
    """What ``action`` of virtual stage ``stage`` waits for, as ``(kind, stage, micro-batch)``: a forward, the previous
    stage's forward; a backward (B), the next stage's B (the last stage: its own forward); a W, its own B."""
    if action.kind == "F":
        return None if stage == 0 else ("F", stage - 1, action.microbatch)
    if action.kind == "W":
        return ("B", stage, action.microbatch)
    return ("F", stage, action.microbatch) if stage == stages - 1 else ("B", stage + 1, action.microbatch)


def _replay(lists: list[list[Action]], v: int, what: str, placement: StagePlacement = "loop"
            ) -> Iterator[tuple[int, Action, int, Optional[tuple[str, int, int]]]]:
    """Every rank's actions of ``lists`` (one list per pipeline rank, v chunks each, placed as ``placement`` says) in
    an order the data dependencies allow (:func:`_needs`), each as ``(rank, action, virtual stage, what it needed)``.

    Raises:
        RuntimeError: if the lists deadlock (``what`` names them).
    """
    p = len(lists)
    done: set[tuple[str, int, int]] = set()
    position = [0] * p
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while position[r] < len(lists[r]):
                a = lists[r][position[r]]
                stage = stage_of_chunk(r, a.chunk, p, placement)
                needs = _needs(a, stage, p * v)
                if needs is not None and needs not in done:
                    break
                done.add((a.kind, stage, a.microbatch))
                position[r] += 1
                progressed = True
                yield r, a, stage, needs
    if any(position[r] < len(lists[r]) for r in range(p)):
        raise RuntimeError(f"{what} deadlocks at {[lists[r][position[r]:][:1] for r in range(p)]}.")


def simulate(schedule: ScheduleName, m: int, p: int, v: int = 1) -> list[int]:
    """Run every rank's list against the data dependencies; return each rank's peak in-flight micro-batches (counted
    per model chunk: with v chunks a rank's count is of micro-batch slices of about L/(p·v) layers each).

    A forward of virtual stage k needs the forward of stage k-1; a backward of stage k needs the
    backward of stage k+1 (or, on the last stage, its own forward); a W needs its own B.

    Raises:
        RuntimeError: if the lists deadlock.
    """
    v = chunks_per_rank(schedule, v)
    lists = [build_schedule(schedule, m, p, v, r) for r in range(p)]
    inflight, peak = [0] * p, [0] * p
    release = "W" if splits_backward(schedule) else "B"
    for r, a, _, _ in _replay(lists, v, f"{schedule} with m={m}, p={p}, v={v}", stage_placement_of(schedule)):
        # a micro-batch is held from its forward to its last backward action (W where there is one)
        inflight[r] += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak[r] = max(peak[r], inflight[r])
    return peak


@functools.lru_cache(maxsize=4096)  # (the planner asks for the same schedule's bubble once per layout sharing it)
def bubble_fraction(schedule: ScheduleName, m: int, p: int, v: int = 1,
                    costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The idle fraction of ``p`` ranks running ``schedule``'s lists under a fixed cost model
    (:func:`trace_bubble_fraction` of the lists :func:`build_schedule` makes).

    For 1F1B this is ``(p − 1)/(m + p − 1)`` with any costs (Narayanan et al. 2021); for ZB-H1 with F = B = W,
    ``(p − 1)/(3m + p − 1)`` (Qi et al. 2024 §2.1); for ZB-V, whose chunks cost half a stage each,
    ``(p − 1)/(6m + p − 1)`` (:func:`zb_v`), and for DualPipeV's lists too (its pairs run one after the other).

    Raises:
        RuntimeError: if the lists deadlock.
    """
    v = chunks_per_rank(schedule, v)
    lists = [build_schedule(schedule, m, p, v, r) for r in range(p)]
    return trace_bubble_fraction(lists, v, splits_backward(schedule), costs, stage_placement_of(schedule))


def trace_bubble_fraction(traces: list[list[Action]], v: int = 1, split: bool = False,
                          costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
                          placement: StagePlacement = "loop") -> float:
    """The idle fraction of the ranks whose actions, in the order each ran them, are ``traces`` (one list per
    pipeline rank, v chunks each, placed as ``placement`` says), under a fixed cost model: an action starts once its
    rank is free and what it needs
    is done (:func:`simulate`'s dependencies), and lasts ``costs`` = (F, B, W) of one chunk (``split``: the backward is
    B then W; else a B lasts B + W); transfers take no time. ``1 − busy / (p · makespan)``.

    Raises:
        RuntimeError: if the traces deadlock.
    """
    p = len(traces)
    duration = {"F": costs[0], "B": costs[1] if split else costs[1] + costs[2], "W": costs[2]}
    times = action_times(traces, v, placement, duration)
    busy = sum(sum(duration[a.kind] for a in trace) for trace in traces)
    return 1 - busy / (p * max(end for rank in times for _, end in rank))


def action_times(lists: list[list[Action]], v: int = 1, placement: StagePlacement = "loop",
                 duration: Optional[dict[str, float]] = None) -> list[list[tuple[float, float]]]:
    """``(start, end)`` of every action of ``lists`` (one list per pipeline rank, v chunks each, placed as
    ``placement`` says), each rank running its list in order, an action starting once its rank is free and what it
    needs (:func:`_needs`) has ended, lasting ``duration[kind]`` (default 1 each); transfers take no time.

    Raises:
        RuntimeError: if the lists deadlock.
    """
    duration = duration or {"F": 1.0, "B": 1.0, "W": 1.0}
    finished: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(lists)
    times: list[list[tuple[float, float]]] = [[] for _ in lists]
    for r, a, stage, needs in _replay(lists, v, "The action lists", placement):
        start = max(clock[r], finished[needs] if needs is not None else 0.0)
        clock[r] = start + duration[a.kind]
        finished[(a.kind, stage, a.microbatch)] = clock[r]
        times[r].append((start, clock[r]))
    return times
