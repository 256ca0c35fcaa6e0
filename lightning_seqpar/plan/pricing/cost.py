"""The step-time model of a layout: every term stated, every rate an input.

``time = compute + tensor-parallel communication + data-parallel communication + pipeline bubble``, nothing assumed
overlapped (an upper bound for a run that overlaps its gradient reduction):

- compute: the rank's hardware FLOPs per step (Eq. 8 with the recomputation chosen; the model FLOPs are Eq. 7)
  over ``efficiency × peak`` FLOP/s;
- tensor (+ sequence) parallel: per layer and micro-batch, the forward's two all-gathers and two reduce-scatters of
  ``e·sbh`` and the backward's four, ``8·(t − 1)/t·e·sbh`` bytes per rank (ring), four more per layer with full
  recomputation, over the intra-node bandwidth;
- data parallel: the gradients' all-reduce, ``2·(d − 1)/d`` of the float32 gradient bytes (zero 1: reduce-scatter
  of them and all-gather of the parameters, the same volume, half of it at each collective's calibrated rate), over
  the inter-node bandwidth when d spans nodes;
- pipeline: ``2·e·sbh / split`` bytes per micro-batch and stage boundary each way, over the inter-node bandwidth;
  the bubble adds ``(p − 1)/(v·m)`` of the compute time;
- expert parallel (a mixture of experts): per MoE layer and micro-batch, the bytes of four all-to-alls (dispatch and
  combine, forward and backward; six under full recomputation) of the ``(e − 1)/e`` of the rank's ``s·b/t·k`` (token,
  expert) pairs bound for other ranks under balanced routing, ``h`` elements each, and the latency of five (eight):
  the dispatch first exchanges its split counts; over the intra-node bandwidth while ``t·e`` ranks fit a node; the
  experts' gradients are all-reduced over their ``t·d/e`` expert data-parallel replicas with the data
  term. The routed experts take no tensor-parallel collective (each is whole on its rank); a shared expert takes the
  MLP's g and ḡ.

Source: Korthikanti et al. 2022 (Eq. 7, 8, §4.2.2 volumes), Narayanan et al. 2021 (bubble).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

GPUS = {  # peak dense bf16 FLOP/s, memory (bytes), NVLink per GPU and network per GPU (bytes/s, one direction)
    "h100": (989e12, 80e9, 450e9, 50e9),
    "h200": (989e12, 141e9, 450e9, 50e9),
    "a100": (312e12, 80e9, 300e9, 25e9),
    "b200": (2250e12, 192e9, 900e9, 50e9),
}


class MeasuredRates(Protocol):
    """Rates measured on one machine, as the step time reads them (the calibration's
    :class:`~lightning_seqpar.plan.measuring.calibration.StepCalibration`, read from its file).

    Attributes:
        optimizer: parameter elements per second one rank's optimizer step updates.
    """

    optimizer: float

    def gemm_rate(self, m: float, k: float, n: float) -> float:
        """FLOP/s of an ``[m, k] × [k, n]`` GEMM."""

    def attention_rate(self, flops: float) -> float:
        """FLOP/s of a core attention call of ``flops``, forward and backward."""

    def link(self, kind: str, n: int) -> Any:
        """The collective ``kind`` over ``n`` ranks: its ``seconds(sent bytes, count)``."""

    def elementwise_seconds(self, operators: float, moved: float, device_busy: float = 0.0,
                            split_projections: float = 0.0) -> float:
        """Seconds of ``operators`` element-wise operators moving ``moved`` bytes, beside ``device_busy`` seconds of
        GEMMs, with the host work of ``split_projections`` projection backwards split into B and W."""


@dataclass(frozen=True)
class Hardware:
    """The rates the step-time model reads.

    Attributes:
        peak_flops: dense 16-bit FLOP/s per GPU.
        memory: bytes per GPU.
        intra_node_bandwidth, inter_node_bandwidth: bytes/s per GPU, one direction (NVLink; the network).
        gpus_per_node: GPUs sharing the intra-node bandwidth.
        efficiency: the fraction of peak FLOP/s a GEMM-bound step reaches (0.5 by default).
        host_bandwidth: bytes/s per GPU, one direction, between the GPU and pinned host memory (activation offload;
            25e9: PCIe 4.0 x16 as measured, about half a PCIe 5.0 link's).
        host_memory: bytes of host memory per GPU an offload may fill (250e9: a DGX H100's 2 TB over 8 GPUs).
        calibration: rates measured on the machine (:class:`MeasuredRates`) that replace ``efficiency``, ``peak_flops``
            and the intra-node bandwidth in :func:`step_times`; ``None``: the step time is a rough estimate.
    """

    peak_flops: float = 989e12
    memory: float = 80e9
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    gpus_per_node: int = 8
    efficiency: float = 0.5
    host_bandwidth: float = 25e9
    host_memory: float = 250e9
    calibration: Optional[MeasuredRates] = None

    @classmethod
    def named(cls, name: str, **overrides: float) -> "Hardware":
        """The defaults of a known GPU (:data:`GPUS`), with ``overrides``.

        Raises:
            ValueError: an unknown name, listing the known ones.
        """
        if name.lower() not in GPUS:
            raise ValueError(f"Unknown GPU {name!r}: one of {sorted(GPUS)}, or give --peak-tflops and the bandwidths.")
        peak, memory, intra, inter = GPUS[name.lower()]
        values = dict(peak_flops=peak, memory=memory, intra_node_bandwidth=intra, inter_node_bandwidth=inter)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def ring_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes each rank sends in a ring ``kind`` (``all_gather``/``reduce_scatter``: ``(n − 1)/n`` of the full
    payload; ``all_reduce``: twice that) among n ranks."""
    if n <= 1:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (n - 1) / n * payload


def attention_flops(shape, batch: int, recompute: str) -> float:
    """The core attention's share of :func:`~lightning_seqpar.memory.flops.hardware_flops_per_iteration`: QKᵀ and
    ·V, ``4·B·s²·h`` per layer forward, three times for forward and backward, Eq. 8's ``12·B·s²·h`` more per layer under
    selective recomputation (as printed), one forward more under full recomputation."""
    forward = 4 * batch * shape.s ** 2 * shape.h
    extra = {"selective": 3 * forward, "full": forward}.get(recompute, 0)
    return shape.L * (3 * forward + extra)


@dataclass(frozen=True)
class Traffic:
    """One kind of a step's communication on one rank: ``sent`` bytes in ``count`` collectives among ``group`` ranks,
    across nodes or not, shared equally between the ``collectives`` named (the calibration's kinds; the
    tensor-parallel g/ḡ: as many all-gathers as reduce-scatters)."""

    sent: float
    count: float
    collectives: tuple[str, ...]
    group: int
    inter_node: bool


def step_times(hardware: Hardware, flops: float, attention_flops: float, gemm: tuple[float, float, float],
               attention_call: float, traffic: dict[str, Traffic], bubble: float,
               optimizer_elements: float = 0.0, elementwise: Optional[tuple[float, float]] = None,
               split_projections: float = 0.0) -> dict[str, float]:
    """Seconds per step of one rank, by term (``compute``, one per ``traffic`` kind, ``bubble``), nothing overlapped.

    Without a calibration (``hardware.calibration`` None) the rates are nominal, a rough estimate: compute at
    ``efficiency × peak_flops``, each transfer at the intra- or inter-node bandwidth. With one (:class:`MeasuredRates`):
    the GEMMs (``flops − attention_flops``) at the measured rate of their class (``gemm``: the layer's ``[m, k] × [k,
    n]`` on this rank), core attention at the measured rate of calls of ``attention_call`` FLOPs, each kind of
    traffic as ``count × latency + sent / bandwidth`` of its collective at its group size; traffic across nodes,
    which one machine cannot measure, keeps the nominal inter-node bandwidth; and ``optimizer``: the optimizer step over
    ``optimizer_elements`` (the parameter elements this rank updates) at the measured rate, and ``elementwise``: the
    ``(operators, bytes)`` of the rank's other operators (:mod:`..measuring.work`) at the measured dispatch time and
    memory bandwidth, the dispatch hidden behind the device's work where the device queues kernels (the nominal model
    has neither term), and ``split``: the host work of ``split_projections`` projection backwards split into B and W
    (a zero-bubble schedule's, per micro-batch), beside that dispatch. The bubble idles for the compute, the
    element-wise work and the split's.

    Args:
        flops, attention_flops: FLOPs this rank executes per step, and the core attention's share of them.
        attention_call: FLOPs of one core-attention call on this rank, forward and backward (``12·b·s²·h/t`` for
            ``b`` sequences of ``s`` local tokens: its size sets its measured rate).
        bubble: the pipeline's idle time as a fraction of the compute time.
    """
    calibration = hardware.calibration
    if calibration is None:
        compute = flops / (hardware.efficiency * hardware.peak_flops)
    else:
        compute = ((flops - attention_flops) / calibration.gemm_rate(*gemm)
                   + attention_flops / calibration.attention_rate(attention_call))
    times = {"compute": compute}
    for kind, t in traffic.items():
        if not t.sent and not t.count:  # nothing sent (a group of one): no rate needed
            times[kind] = 0.0
        elif t.inter_node or calibration is None:
            times[kind] = t.sent / (hardware.inter_node_bandwidth if t.inter_node else hardware.intra_node_bandwidth)
        else:
            share = len(t.collectives)
            times[kind] = sum(calibration.link(name, max(t.group, 2)).seconds(t.sent / share, t.count / share)
                              for name in t.collectives)
    busy = compute
    if calibration is not None and elementwise is not None:
        times["elementwise"] = calibration.elementwise_seconds(*elementwise, device_busy=compute)
        busy += times["elementwise"]
    if calibration is not None and split_projections:  # what the split's host work adds to the element-wise term
        together = calibration.elementwise_seconds(*(elementwise or (0.0, 0.0)), compute, split_projections)
        times["split"] = together - times.get("elementwise", 0.0)
        busy += times["split"]
    times["bubble"] = bubble * busy
    if calibration is not None:
        times["optimizer"] = optimizer_elements / calibration.optimizer
    return times
