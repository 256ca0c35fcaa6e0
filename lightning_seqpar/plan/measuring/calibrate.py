"""``python -m lightning_seqpar.plan calibrate --out FILE``: measure this machine's rates for the step-time model and
write them (:class:`~.calibration.StepCalibration`); ``python -m lightning_seqpar.plan ... --calibration FILE`` reads
them.

Run it where the training runs: on a GPU node ``torchrun --nproc-per-node 8 -m lightning_seqpar.plan calibrate --out
FILE`` (NCCL, bfloat16 GEMMs), or on its own, which starts ``--processes`` local processes (default: the GPUs, else 2;
gloo on CPU, float32). Every rank measures the same things in the same order (NCCL matches collectives by order):

- GEMMs ``[n, n] × [n, n]``, an AdamW step (multi-tensor, float32), core attention (``scaled_dot_product_attention``,
  causal, forward and backward, 8 heads of 64) and element-wise work (the bytes per second and dispatch of a Llama
  decoder layer's element-wise operators, and what splitting its backward into B and W adds: :mod:`.calibrate_layer`)
  on every rank at once, as training runs them: each the median of five rounds that time every measurement once
  (trials of at least 20 ms after a warm-up; on CUDA with events), kept as the slowest rank's time. Ranks share the
  host (its cores' caches and memory bandwidth; on a GPU node, the CPU that dispatches): on 2 cores a float32 GEMM
  of 128 ran at 95 GFLOP/s alone and 74-79 beside its peer;
- each collective (:data:`~.calibration.COLLECTIVES`) over the group of the first n ranks for n = 2, 4, … ≤ world, at
  three message sizes, through the library's own :class:`~lightning_seqpar.parallel.collectives.ParallelGroup` (the
  g/ḡ, gradient and dispatch paths the layers run; ``send_recv`` is the ring exchange of context-parallel attention
  and the pipeline's batches); a message's time is the slowest rank's, the median of five rounds. ``time = α + sent/β``
  is fitted by least squares over the sizes (α ≥ 0); then α is the smallest message's time as a step sees it, where
  that is larger: its time back to back plus the mean wait a call adds after a burst of compute on every rank, pooled
  over the kinds (:func:`_after_compute`, :func:`_link`): a step calls its collectives between GEMMs.

Raises (CLI): ``--processes`` below 2 or above the GPUs: collectives need two ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_seqpar.plan.measuring.calibration import COLLECTIVES, Link, StepCalibration

SIZES = {  # (GEMM n, attention calls, message bytes, optimizer elements) per device kind
    # an attention call: (s, sequences × heads, head dim); from a launch-bound call to one of a long-context layer
    "cpu": ((64, 128, 256), ((64, 8, 64), (128, 8, 64), (256, 8, 64)), (1 << 12, 1 << 18, 1 << 22), 1 << 20),
    "cuda": ((1024, 4096, 8192), ((1024, 8, 64), (1024, 32, 128), (2048, 64, 128), (8192, 32, 128)),
             (1 << 16, 1 << 22, 1 << 26), 1 << 26),
}


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """``measure(fn, repeats)``: seconds per call of ``fn``, after one warm-up call (CUDA: events, synchronized)."""

    def measure(fn: Callable[[], object], repeats: int) -> float:
        fn()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) / repeats

    return measure


TRIAL_SECONDS, ROUNDS = 0.02, 5  # a trial: at least 20 ms of calls; each measurement's median over 5 rounds


Slowest = Callable[[float], float]
"""the slowest rank's value of a time every rank measured (one collective call per call: every rank calls it as
often, in the same order)"""


def _alone(seconds: float) -> float:
    return seconds


def _timed_in_rounds(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int,
                     slowest: Slowest = _alone) -> list[float]:
    """Seconds per call of each of ``fns``: each one's calls per trial fixed after a warm-up (at least ``repeats``
    and :data:`TRIAL_SECONDS`), then :data:`ROUNDS` rounds that time every one of them once, in order, and each one's
    median over the rounds, then ``slowest`` of it. A small CPU GEMM takes microseconds: a few calls timed once were
    mostly the timer's and the scheduler's noise; and a spell of a busy host during one measurement alone had put a
    layer's element-wise rate (its time less its GEMMs', measured before it) at half another run's. In rounds such a
    spell slows every measurement alike. The number of calls is each rank's choice (no collective inside a ``fn``)."""
    measure = _timer(device)
    calls = [max(repeats, math.ceil(TRIAL_SECONDS / max(measure(fn, 1), 1e-9))) for fn in fns]
    trials: list[list[float]] = [[] for _ in fns]
    for _ in range(ROUNDS):
        for fn, n, times in zip(fns, calls, trials):
            times.append(measure(fn, n))
    return [slowest(statistics.median(times)) for times in trials]


def slowest_rank(device: torch.device, group: Optional[dist.ProcessGroup] = None) -> Slowest:
    """:data:`Slowest` over ``group`` (default: the world): an all-reduce (max) of one float64 on ``device``."""

    def slowest(seconds: float) -> float:
        value = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return float(value)

    return slowest


def _optimizer_step(device: torch.device) -> tuple[Callable[[], object], int]:
    """``(step, elements)``: ``torch.optim.AdamW(foreach=True)`` over 8 float32 tensors."""
    elements = SIZES[device.type][3]
    params = [torch.zeros(elements // 8, device=device, requires_grad=True) for _ in range(8)]
    for param in params:
        param.grad = torch.randn_like(param)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True).step, elements


def _gemm(n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return lambda: a @ b


def _attention(s: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype)

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return step


def _elementwise_rates(device: torch.device, layers: list[tuple[int, int, float]]) -> tuple[float, float]:
    """``(memory, dispatch)``: bytes/s of element-wise work and seconds per operator's dispatch, from ``layers``:
    ``(operators, bytes, seconds)`` of a Llama decoder layer forward and backward at a tiny size and at a model's
    (:mod:`.calibrate_layer`), the seconds less its GEMMs and core attention at their measured rates. On CPU
    ``time = operators · dispatch + bytes / memory`` at both sizes, solved for the two; on CUDA the tiny layer is the
    host's (dispatch) and the large one the device's (bytes), the other hidden behind it. A rate the noise would
    make negative is clamped (dispatch 0, memory 10¹² bytes/s: free)."""
    (ops_small, bytes_small, small), (ops_large, bytes_large, large) = layers
    if device.type == "cuda":
        return bytes_large / max(large, 1e-12), small / ops_small
    determinant = ops_small * bytes_large - ops_large * bytes_small
    dispatch = (small * bytes_large - large * bytes_small) / determinant
    per_byte = (ops_small * large - ops_large * small) / determinant
    return 1 / max(per_byte, 1e-12), max(dispatch, 0.0)


def measure_device_rates(device: torch.device, repeats: int = 3, slowest: Slowest = _alone) -> StepCalibration:
    """The rates one process measures on ``device`` (GEMMs, core attention, the optimizer step, element-wise work:
    bfloat16 on CUDA, float32 on CPU), without collectives (``world`` 1): what a one-device layout's step time reads.
    Alone no process group is needed; with ``slowest`` (:func:`slowest_rank`) every rank of its group measures at
    once and each time is the slowest rank's. Every measurement is timed in the same rounds
    (:func:`_timed_in_rounds`)."""
    from lightning_seqpar.plan.measuring.calibrate_layer import LAYER_SIZES, PROJECTIONS, layer_step
    from lightning_seqpar.plan.measuring.work import OperatorCounter

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm_sizes, attention_calls = SIZES[device.type][:2]
    fns: list[Callable[[], object]] = [_gemm(n, device, dtype) for n in gemm_sizes]
    fns += [_attention(s, heads, head_dim, device, dtype) for s, heads, head_dim in attention_calls]
    layers = []
    for size in LAYER_SIZES[device.type]:
        step, gemm_flops, attention_flops = layer_step(size, device, dtype)
        step()  # the gradients exist: the counted step accumulates into them, as the timed ones do
        counter = OperatorCounter()
        with counter:
            step()
        fns.append(step)
        layers.append((size, counter.operators, counter.bytes, gemm_flops, attention_flops))
    split_step = layer_step(LAYER_SIZES[device.type][0], device, dtype, split=True)[0]
    optimizer_step, elements = _optimizer_step(device)
    seconds = _timed_in_rounds(fns + [split_step, optimizer_step], device, repeats, slowest)
    gemm = tuple((n, 2 * n ** 3 / t) for n, t in zip(gemm_sizes, seconds))
    flops = [12 * s * s * heads * head_dim for s, heads, head_dim in attention_calls]
    attention = tuple((f, f / t) for f, t in zip(flops, seconds[len(gemm):]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = StepCalibration(name, "nccl" if device.type == "cuda" else "gloo", 1, gemm, attention, (),
                            elements / seconds[-1], memory=1.0, dispatch=0.0)  # element-wise: from the layers below
    priced = []  # each layer's time less its GEMMs and attention, as the planner prices them
    layer_seconds = seconds[len(gemm) + len(attention):-2]
    for ((b, s, h, _, f), operators, moved, gemm_flops, attention_flops), t in zip(layers, layer_seconds):
        compute = gemm_flops / rates.gemm_rate(b * s, h, f) + attention_flops / rates.attention_rate(attention_flops)
        priced.append((operators, moved, max(t - compute, 0.0)))
    memory, dispatch = _elementwise_rates(device, priced)
    split = max(0.0, seconds[-2] - layer_seconds[0]) / PROJECTIONS  # the same tiny layer, its backward split
    return dataclasses.replace(rates, memory=memory, dispatch=dispatch, split=split)


def _fit(points: list[tuple[float, float]]) -> Link:
    """Least squares ``time = α + sent/β`` over ``(sent, seconds)``; α clipped at 0 (then β from the slope through
    the origin)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-30)
    alpha = my - slope * mx
    if alpha < 0 or slope <= 0:
        alpha, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return Link(alpha, 1 / max(slope, 1e-30))


def _link(back_to_back: list[tuple[float, float]], wait: float) -> Link:
    """The link of ``(sent bytes, seconds)`` back to back per message size, the smallest first, and the ``wait`` a call
    adds after compute (:func:`_after_compute`, pooled): the bandwidth fitted back to back (:func:`_fit`), where a
    transfer's bytes show; the latency a step pays, the smallest message's time back to back plus ``wait`` less its
    bytes, or the fitted one where that is larger."""
    fit = _fit(back_to_back)
    sent, seconds = back_to_back[0]
    return Link(max(fit.latency, seconds + wait - sent / fit.bandwidth), fit.bandwidth)


def _sent(kind: str, payload: int, n: int) -> float:
    """Bytes each rank sends: ``payload`` is the gathered / reduced / exchanged tensor (ring convention)."""
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(kind, (n - 1) / n) * payload


BURST_SECONDS, AFTER_COMPUTE_CALLS = 2e-3, 60
"""a collective's latency is timed after this much compute on every rank, as a layer calls its collectives between
GEMMs, over this many calls"""


def _burst(device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """About :data:`BURST_SECONDS` of GEMMs (the middle class's, repeated) on ``device``."""
    gemm = _gemm(SIZES[device.type][0][1], device, dtype)
    calls = max(1, round(BURST_SECONDS / max(_timer(device)(gemm, 5), 1e-9)))

    def burst() -> None:
        for _ in range(calls):
            gemm()

    return burst


def _after_compute(calls: Sequence[Callable[[], object]], burst: Callable[[], None],
                   measure: Callable[[Callable[[], object], int], float]) -> list[float]:
    """Mean seconds each of ``calls`` adds after ``burst``: a step calls a collective after compute, when the ranks
    arrive apart by their compute's jitter and a transport idle since its last message must wake. Back to back,
    gloo's all-gather of 2 KB on 2 CPU processes took 0.1 ms; after 2 ms of GEMMs, 0.7-1.6 ms on the mean (a bimodal
    0.2 or 2-3 ms: a woken thread waits for a core the other rank's compute holds), and tensor parallelism with 8
    micro-batches of 1 (256 collectives a step) was priced at 0.55-0.60 of its measured step with the first,
    0.82-0.93 with the second. The mean, not a median: every call of a step pays its draw. Timed in :data:`ROUNDS`
    rounds that each time the burst alone and every call after it, as :func:`_timed_in_rounds` does: a spell of a
    busy host shifts every collective's latency alike, not one's."""
    share = max(1, AFTER_COMPUTE_CALLS // ROUNDS)
    alone, after = [], [[] for _ in calls]
    for _ in range(ROUNDS):
        alone.append(measure(burst, share))
        for call, times in zip(calls, after):
            times.append(measure(lambda: (burst(), call()), share))
    base = statistics.mean(alone)
    return [max(statistics.mean(times) - base, 0.0) for times in after]


def _collective(kind: str, group, numel: int, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    """One call of ``kind`` over ``group`` (a :class:`~lightning_seqpar.parallel.collectives.ParallelGroup`) on a
    ``numel``-element message: the layers' own paths (``send_recv``: the ring exchange that context-parallel attention
    and the pipeline's batches post, one send and one receive per rank)."""
    x = torch.randn(numel, device=device, dtype=dtype)
    return {"all_gather": lambda: group.all_gather(x[: numel // group.size]),
            "reduce_scatter": lambda: group.reduce_scatter(x),
            "all_reduce": lambda: group.all_reduce(x.clone()),
            "all_to_all": lambda: group.all_to_all(x),
            "send_recv": lambda: group.ring_exchange_start(x).wait()}[kind]


def measure_rates(rank: int, world: int, repeats: int = 3) -> Optional[StepCalibration]:
    """Measure on every rank of the default process group (already initialized); rank 0 returns the calibration,
    the others ``None``. Every rank makes the same collective calls in the same order."""
    from lightning_seqpar.parallel.collectives import ParallelGroup

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    element = torch.finfo(dtype).bits // 8
    dist.barrier()  # the ranks start their first measurement together, as training runs them
    local = measure_device_rates(device, repeats, slowest_rank(device))
    measure = _timer(device)
    links = []
    sizes = [n for n in (2 ** i for i in range(1, world.bit_length())) if n <= world]
    burst = _burst(device, dtype)
    for n in sizes:
        handle = dist.new_group(list(range(n)))  # every rank creates every group, in the same order
        group = ParallelGroup(handle) if rank < n else None
        kinds = [kind for kind in COLLECTIVES if kind != "send_recv" or n == 2]
        back_to_back: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
        for kind in kinds:
            for payload in SIZES[device.type][2]:
                seconds = torch.zeros((), device=device, dtype=torch.float64)
                if group is not None:
                    call = _collective(kind, group, payload // element // n * n, device, dtype)
                    dist.barrier(group=handle)
                    seconds += statistics.median(measure(call, repeats) for _ in range(ROUNDS))
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time
                back_to_back[kind].append((_sent(kind, payload, n), float(seconds)))
        after = torch.zeros(len(kinds), device=device, dtype=torch.float64)
        if group is not None:
            smallest = SIZES[device.type][2][0] // element // n * n
            after += torch.tensor(_after_compute([_collective(kind, group, smallest, device, dtype) for kind in kinds],
                                                 burst, measure), dtype=torch.float64, device=device)
        dist.all_reduce(after, op=dist.ReduceOp.MAX)
        # what a call waits beyond its time back to back (the ranks' jitter, a transport waking) is the host's, not
        # the collective's: pooled over the kinds, four or five times the draws
        delay = statistics.mean(max(seconds - back_to_back[kind][0][1], 0.0)
                                for kind, seconds in zip(kinds, after.tolist()))
        links += [(kind, n, _link(back_to_back[kind], delay)) for kind in kinds]
        dist.barrier()
    if rank != 0:
        return None
    return dataclasses.replace(local, backend=dist.get_backend(), world=world, collectives=tuple(links))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank(rank: int, world: int, port: int, out: str, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run(rank, world, out, repeats)


def _run(rank: int, world: int, out: str, repeats: int) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        calibration = measure_rates(rank, world, repeats)
        if calibration is not None:
            calibration.save(out)
            print(f"calibrated {calibration.describe()}: wrote {out}")
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_seqpar.plan calibrate --out FILE [--processes N] [--repeats K]``: measure (see the module
    docstring) on this process's torchrun group, or on N local processes it starts, and write FILE (JSON,
    :class:`~.calibration.StepCalibration`); returns 0. ``--processes 1`` measures this process's device alone (no
    process group, no collectives: :func:`measure_device_rates`), enough to plan one-device layouts.

    Raises:
        SystemExit: (argparse) ``--processes`` below 1 or above the GPUs, or ``--repeats`` below 1, before any process
            starts.
    """
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.plan calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the calibration file to write (JSON)")
    parser.add_argument("--processes", type=int, default=None,
                        help="local processes to start when not launched by torchrun (default: the GPUs, else 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement, after a warm-up")
    args = parser.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.out, args.repeats)
        return 0
    gpus = torch.cuda.device_count()
    processes = args.processes if args.processes is not None else (gpus if gpus else 2)
    if processes < 1 or (gpus and processes > gpus) or args.repeats < 1:
        parser.error(f"--processes {processes} (and --repeats {args.repeats}): 1 process (its device alone) or more "
                     f"(collectives too){f', at most the {gpus} GPUs' if gpus else ''}, and at least one repeat.")
    if processes == 1:
        calibration = measure_device_rates(torch.device("cuda" if gpus else "cpu"), args.repeats)
        calibration.save(args.out)
        print(f"calibrated {calibration.describe()} (no collectives: one-device layouts): wrote {args.out}")
        return 0
    import torch.multiprocessing as mp

    mp.start_processes(_local_rank, args=(processes, _free_port(), args.out, args.repeats), nprocs=processes,
                       start_method="spawn")
    return 0
