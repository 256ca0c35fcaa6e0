"""Measured rates of one machine, which the step-time model (:func:`~..pricing.cost.step_times`) reads in place of
nominal
ones: ``python -m lightning_seqpar.plan calibrate --out FILE`` writes them (:mod:`.calibrate`), ``--calibration FILE``
reads them.

- GEMM throughput by shape class: FLOP/s of an ``n × n`` by ``n × n`` product (``2n³`` FLOPs) at several n; a layout's
  GEMMs are classed by the geometric mean of their three sizes (``s·b/c`` tokens, ``h``, ``f/t``) and the rate
  interpolated log-linearly between the two nearest classes (the end classes beyond).
- Core attention: FLOP/s of one forward and backward of causal attention (``12·b·s²·h`` FLOPs, Eq. 7's attention
  share) by the FLOPs of one call, at several sizes: a call's rate depends on how much work it holds (on a GPU a
  call of a few GFLOP is bound by its launch, one of a TFLOP by the tensor cores), so a layout's calls are priced at
  their own size (``b`` micro-batch sequences, the rank's ``h/t`` query width, its local ``s``).
- The optimizer step: parameter elements per second of a multi-tensor AdamW step (float32 state, as the strategy's
  optimizers keep it).
- Element-wise work (:mod:`.work`): the bytes per second a model's element-wise operators read and write (as
  :class:`~.work.OperatorCounter` counts them) and the seconds one operator's dispatch takes, both from a Llama decoder
  layer forward and backward at a tiny size and at a model's, less its GEMMs and attention at the rates above
  (:mod:`.calibrate_layer`). On a device that queues kernels (CUDA) the host's dispatch runs ahead while the device
  works: it shows only where it outlasts the device's work (:meth:`StepCalibration.elementwise_seconds`).
- The split backward of a zero-bubble schedule: the host seconds per projection and micro-batch that B and W apart
  add to the unsplit backward (the layers' own autograd functions, W's closure and accumulation), from the tiny layer
  run both ways (:mod:`.calibrate_layer`). On CPU the step pays it; on CUDA it joins the host's dispatch, hidden where
  the device works longer.
- Each collective by group size: latency α (s) and bandwidth β (bytes/s) fitted to ``time = α + sent/β``, ``sent``
  the bytes each rank sends (:func:`~..pricing.cost.ring_bytes`' convention), over messages of several sizes back to
  back; α is a small message's time as a step sees it, after compute on every rank, where that is larger
  (:func:`~.calibrate._link`).

A file is JSON (``format`` 6; an older one is refused, measure again: format 1 had no element-wise rates, format 2
keyed attention by sequence length, which priced a launch-bound small call's rate for a model's large ones, format 3
measured element-wise work on an in-place add, 4× a small Llama's rate on CPU, and rank 0 alone, format 4 timed
collectives back to back only, a tenth of their latency after compute on 2 CPU processes, format 5 had no
split-backward overhead); a damaged or edited one is
refused naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

FORMAT = 6
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
"""The collectives measured: the tensor-parallel g/ḡ pair, data-parallel gradient reduction, expert dispatch and
all-to-all context parallelism, pipeline and ring-attention transfers."""


@dataclass(frozen=True)
class Link:
    """One collective at one group size: ``time = latency + sent / bandwidth`` (seconds; bytes/s, ``sent`` the bytes
    each rank sends)."""

    latency: float
    bandwidth: float

    def seconds(self, sent: float, count: float) -> float:
        """Seconds of ``count`` collectives sending ``sent`` bytes per rank in all."""
        return count * self.latency + sent / self.bandwidth if count else 0.0


@dataclass(frozen=True)
class StepCalibration:
    """The rates measured on one machine.

    Attributes:
        device: what measured them (e.g. ``cpu``, ``NVIDIA H100 80GB HBM3``). backend: ``gloo`` or ``nccl``.
        world: the processes that took part (the largest group size measured).
        gemm: ``(n, FLOP/s)`` per GEMM class, ascending n.
        attention: ``(FLOPs of one call, FLOP/s)`` of core attention forward and backward, ascending FLOPs.
        collectives: ``(kind, group size, Link)``, kind one of :data:`COLLECTIVES`; none where one process measured
            (``world`` 1: :func:`~.calibrate.measure_device_rates`, enough for a one-device layout).
        optimizer: parameter elements per second one rank's AdamW step updates.
        memory: bytes per second a model's element-wise operators read and write (allocation, broadcasting and
            arithmetic-bound ones such as the softmax's included).
        dispatch: seconds per operator beside its bytes (Python, autograd, a kernel's launch; views included,
            which launch none): the host's time.
        split: host seconds a split backward (B, then W) adds per projection and micro-batch.
    """

    device: str
    backend: str
    world: int
    gemm: tuple[tuple[int, float], ...]
    attention: tuple[tuple[int, float], ...]
    collectives: tuple[tuple[str, int, Link], ...]
    optimizer: float
    memory: float
    dispatch: float
    split: float = 0.0

    @property
    def asynchronous(self) -> bool:
        """Whether the device runs kernels the host queued (CUDA) rather than each operator in the caller (CPU)."""
        return self.device != "cpu"

    def elementwise_seconds(self, operators: float, moved: float, device_busy: float = 0.0,
                            split_projections: float = 0.0) -> float:
        """Seconds of ``operators`` element-wise operators reading and writing ``moved`` bytes in all, in a step whose
        other device work (GEMMs, core attention) takes ``device_busy`` seconds; with the host work of
        ``split_projections`` projection backwards split into B and W (per micro-batch: :attr:`split`).

        On CPU each operator's dispatch and bytes take their turn: the sum. On an asynchronous device the host
        queues kernels ahead of the device, so the dispatch is hidden behind the device's work (``device_busy`` and
        the bytes' own time) and only what outlasts it shows: a 1B-parameter Llama step on an H200 dispatched its
        3,594 element-wise operators in 0.09 s of host time beside 0.11 s of GEMMs and bytes.
        """
        moving = moved / self.memory
        host = operators * self.dispatch + split_projections * self.split
        if not self.asynchronous:
            return host + moving
        return moving + max(0.0, host - device_busy - moving)

    def gemm_rate(self, m: float, k: float, n: float) -> float:
        """FLOP/s of an ``[m, k] × [k, n]`` GEMM (its class: ``(m·k·n)^(1/3)``)."""
        return _interpolate(self.gemm, (m * k * n) ** (1 / 3))

    def attention_rate(self, flops: float) -> float:
        """FLOP/s of core attention in calls of ``flops`` FLOPs each (forward and backward)."""
        return _interpolate(self.attention, flops)

    def link(self, kind: str, n: int) -> Link:
        """The rates of ``kind`` among ``n`` ranks: those measured at ``n``, else at the nearest measured size (below
        ``n`` when larger groups were not measured: a ring's per-rank bandwidth barely changes with its size).

        Raises:
            ValueError: no rates of ``kind`` (a calibration of one process), naming the command that measures them.
        """
        sizes = sorted(size for k, size, _ in self.collectives if k == kind)
        if not sizes:
            raise ValueError(f"The calibration ({self.describe()}) has no {kind} rates: a layout over several ranks "
                             f"needs a calibration measured on 2 or more processes (`python -m "
                             f"lightning_seqpar.plan calibrate --processes 2 ...`).")
        near = min(sizes, key=lambda size: (abs(math.log(size / n)), -size))
        return next(link for k, size, link in self.collectives if k == kind and size == near)

    def describe(self) -> str:
        return f"{self.device}, {self.backend}, {self.world} processes"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "device": self.device, "backend": self.backend, "world": self.world,
                "gemm": [list(r) for r in self.gemm], "attention": [list(r) for r in self.attention],
                "collectives": [[k, n, link.latency, link.bandwidth] for k, n, link in self.collectives],
                "optimizer": self.optimizer, "memory": self.memory, "dispatch": self.dispatch, "split": self.split}

    def save(self, path: Union[str, Path]) -> None:
        """Write the file (whole or not at all: a temporary file renamed over it)."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(self.to_json(), indent=1))
        partial.replace(path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "StepCalibration":
        """Read a file :meth:`save` wrote.

        Raises:
            ValueError: not JSON, another format, or a field missing, non-positive or of another kind; the message
                names the file and the field, and says to run ``calibrate`` again.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{path}: not a calibration file ({error}). Write one with `python -m "
                             f"lightning_seqpar.plan calibrate --out {path}`.") from None
        try:
            return cls._parse(data)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: a damaged or edited calibration file ({error}). Write it again with `python -m "
                             f"lightning_seqpar.plan calibrate --out {path}`.") from None

    @classmethod
    def _parse(cls, data: dict) -> "StepCalibration":
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']!r}, this version reads {FORMAT}")
        rates = {}
        for field in ("gemm", "attention"):
            rows = tuple((int(size), float(rate)) for size, rate in data[field])
            if not rows or any(size < 1 or not rate > 0 for size, rate in rows):
                raise ValueError(f"{field!r} needs (size >= 1, FLOP/s > 0) rows, got {data[field]!r}")
            rates[field] = tuple(sorted(rows))
        links = []
        for kind, n, latency, bandwidth in data["collectives"]:
            if kind not in COLLECTIVES or int(n) < 2 or float(latency) < 0 or not float(bandwidth) > 0:
                raise ValueError(f"'collectives' row {[kind, n, latency, bandwidth]!r}: a kind of {COLLECTIVES}, "
                                 f"n >= 2, latency >= 0, bandwidth > 0")
            links.append((kind, int(n), Link(float(latency), float(bandwidth))))
        missing = [kind for kind in COLLECTIVES if not any(k == kind for k, _, _ in links)]
        if missing and int(data["world"]) > 1:  # one process measures no collective
            raise ValueError(f"'collectives' has no rows for {missing}")
        optimizer, memory, dispatch, split = (float(data[k]) for k in ("optimizer", "memory", "dispatch", "split"))
        if not optimizer > 0 or not memory > 0 or not dispatch >= 0 or not split >= 0:
            raise ValueError(f"'optimizer' needs elements/s > 0, 'memory' bytes/s > 0, 'dispatch' and 'split' seconds "
                             f">= 0, got {data['optimizer']!r}, {data['memory']!r}, {data['dispatch']!r}, "
                             f"{data['split']!r}")
        return cls(str(data["device"]), str(data["backend"]), int(data["world"]), rates["gemm"], rates["attention"],
                   tuple(links), optimizer, memory, dispatch, split)


def _interpolate(rows: tuple[tuple[int, float], ...], x: float) -> float:
    """``rows``' rate at ``x``, log-linear between the neighbouring sizes, the end rates beyond them."""
    if x <= rows[0][0]:
        return rows[0][1]
    for (x0, r0), (x1, r1) in zip(rows, rows[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
    return rows[-1][1]
