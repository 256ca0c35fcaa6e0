"""``python -m lightning_seqpar.plan calibrate --out FILE``: measure this machine's rates for the step-time model and
write them (:class:`~.calibration.StepCalibration`); ``python -m lightning_seqpar.plan ... --calibration FILE`` reads
them.

Run it where the training runs: on a GPU node ``torchrun --nproc-per-node 8 -m lightning_seqpar.plan calibrate --out
FILE`` (NCCL, bfloat16 GEMMs), or on its own, which starts ``--processes`` local processes (default: the GPUs, else 2;
gloo on CPU, float32). Every rank measures the same things in the same order (NCCL matches collectives by order):

- GEMMs ``[n, n] × [n, n]``, an AdamW step (multi-tensor, float32), core attention (``scaled_dot_product_attention``,
  causal, forward and backward, 8 heads of 64) and element-wise work (an in-place add's bytes per second over large
  tensors; a small operator's dispatch) on rank 0, timed after a warm-up as the median of three trials of at least
  20 ms (on CUDA with events; no other rank runs meanwhile);
- each collective (:data:`~.calibration.COLLECTIVES`) over the group of the first n ranks for n = 2, 4, … ≤ world, at
  three message sizes, through the library's own :class:`~lightning_seqpar.parallel.collectives.ParallelGroup` (the
  g/ḡ, gradient and dispatch paths the layers run); a message's time is the slowest rank's, and ``time = α + sent/β``
  is fitted by least squares over the sizes (α ≥ 0).

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

from lightning_seqpar.plan.calibration import COLLECTIVES, Link, StepCalibration

SIZES = {  # (GEMM n, attention calls, message bytes, optimizer elements, element-wise elements) per device kind
    # an attention call: (s, sequences × heads, head dim); from a launch-bound call to one of a long-context layer
    "cpu": ((64, 128, 256), ((64, 8, 64), (128, 8, 64), (256, 8, 64)), (1 << 12, 1 << 16, 1 << 20), 1 << 20, 1 << 22),
    "cuda": ((1024, 4096, 8192), ((1024, 8, 64), (1024, 32, 128), (2048, 64, 128), (8192, 32, 128)),
             (1 << 16, 1 << 22, 1 << 26), 1 << 26, 1 << 27),
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


TRIAL_SECONDS, TRIALS = 0.02, 3  # a rank-0 measurement: trials of at least 20 ms each, their median


def _steady_timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """``measure(fn, repeats)``: seconds per call of ``fn``, the median of :data:`TRIALS` trials of at least
    ``repeats`` calls and :data:`TRIAL_SECONDS` each. A small CPU GEMM takes microseconds: a few calls timed once were
    mostly the timer's and the scheduler's noise (the planned times of one layout moved by 10 % between calibrations).
    For measurements on rank 0 alone: the number of calls is this rank's choice, which a collective's must not be."""
    measure = _timer(device)

    def steady(fn: Callable[[], object], repeats: int) -> float:
        once = measure(fn, 1)
        calls = max(repeats, math.ceil(TRIAL_SECONDS / max(once, 1e-9)))
        return statistics.median(measure(fn, calls) for _ in range(TRIALS))

    return steady


def _optimizer_rate(device: torch.device, repeats: int) -> float:
    """Elements per second of ``torch.optim.AdamW(foreach=True)`` over 8 float32 tensors."""
    elements = SIZES[device.type][3]
    params = [torch.zeros(elements // 8, device=device, requires_grad=True) for _ in range(8)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return elements / _steady_timer(device)(optimizer.step, repeats)


def _elementwise_rates(device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """``(memory, dispatch)``: bytes/s of an in-place add over two large tensors (read both, write one, as
    :class:`~.work.OperatorCounter` counts it), and seconds per operator of four tiny pre-norm MLP blocks forward and
    backward (the module code between operators included, as a model runs it), less their bytes' time, over the
    operators the counter counts in them (their GEMMs included: a launch is a launch; their FLOPs take microseconds
    at this size)."""
    from lightning_seqpar.plan.work import OperatorCounter

    measure = _steady_timer(device)
    n = SIZES[device.type][4]
    a, b = torch.zeros(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
    counter = OperatorCounter()
    with counter:
        a.add_(b)
    memory = counter.bytes / measure(lambda: a.add_(b), repeats)
    width = 16
    block = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                                    torch.nn.GELU(), torch.nn.Linear(4 * width, width))
                                for _ in range(4)).to(device, dtype)
    x = torch.randn(8, width, device=device, dtype=dtype, requires_grad=True)

    def chain() -> None:  # module code between the operators, as a model's: pre-norm MLP blocks with residuals
        y = x
        for layer in block:
            y = y + layer(y)
        y.sum().backward()

    counter = OperatorCounter()
    with counter:
        chain()
    seconds = measure(chain, repeats) - counter.bytes / memory
    return memory, max(seconds, 0.0) / counter.operators


def _compute_rates(device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[list, list]:
    measure = _steady_timer(device)
    gemm_sizes, attention_calls = SIZES[device.type][:2]
    gemm = []
    for n in gemm_sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        gemm.append((n, 2 * n ** 3 / measure(lambda: a @ b, repeats)))
    attention = []
    for s, heads, head_dim in attention_calls:
        q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype)

        def step() -> None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)

        flops = 12 * s * s * heads * head_dim
        attention.append((flops, flops / measure(step, repeats)))
    return gemm, attention


def measure_device_rates(device: torch.device, repeats: int = 3) -> StepCalibration:
    """The rates one process measures on ``device`` (GEMMs, core attention, the optimizer step, element-wise work:
    bfloat16 on CUDA, float32 on CPU), without collectives (``world`` 1): what a one-device layout's step time reads.
    No process group is needed."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gemm, attention = _compute_rates(device, dtype, repeats)
    memory, dispatch = _elementwise_rates(device, dtype, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return StepCalibration(name, "nccl" if device.type == "cuda" else "gloo", 1, tuple(gemm), tuple(attention), (),
                           _optimizer_rate(device, repeats), memory, dispatch)


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


def _sent(kind: str, payload: int, n: int) -> float:
    """Bytes each rank sends: ``payload`` is the gathered / reduced / exchanged tensor (ring convention)."""
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(kind, (n - 1) / n) * payload


def measure_rates(rank: int, world: int, repeats: int = 3) -> Optional[StepCalibration]:
    """Measure on every rank of the default process group (already initialized); rank 0 returns the calibration,
    the others ``None``. Every rank makes the same collective calls in the same order."""
    from lightning_seqpar.parallel.collectives import ParallelGroup

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    element = torch.finfo(dtype).bits // 8
    local = measure_device_rates(device, repeats) if rank == 0 else None
    dist.barrier()
    measure = _timer(device)
    links = []
    sizes = [n for n in (2 ** i for i in range(1, world.bit_length())) if n <= world]
    for n in sizes:
        handle = dist.new_group(list(range(n)))  # every rank creates every group, in the same order
        group = ParallelGroup(handle) if rank < n else None
        for kind in COLLECTIVES:
            if kind == "send_recv" and n != 2:
                continue
            points = []
            for payload in SIZES[device.type][2]:
                seconds = torch.zeros((), device=device, dtype=torch.float64)
                if group is not None:
                    numel = payload // element // n * n
                    x = torch.randn(numel, device=device, dtype=dtype)
                    call = {"all_gather": lambda: group.all_gather(x[: numel // n]),
                            "reduce_scatter": lambda: group.reduce_scatter(x),
                            "all_reduce": lambda: group.all_reduce(x.clone()),
                            "all_to_all": lambda: group.all_to_all(x),
                            "send_recv": lambda: (dist.send(x, 1, group=handle) if rank == 0
                                                  else dist.recv(x, 0, group=handle))}[kind]
                    dist.barrier(group=handle)
                    seconds += measure(call, repeats)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time
                points.append((_sent(kind, payload, n), float(seconds)))
            links.append((kind, n, _fit(points)))
        dist.barrier()
    if local is None:
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
