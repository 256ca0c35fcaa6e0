"""The work of a step beside its GEMMs' and core attention's FLOPs, counted on small copies of the model: every
operator's dispatch (the host's time) and the bytes each element-wise operator reads and writes. The step-time model
prices it beside the GEMMs and core attention (:func:`~..pricing.cost.step_times`, ``elementwise``): ``operators ×
dispatch``
and ``bytes / memory bandwidth``, both rates measured by ``calibrate``, the dispatch hidden behind the device's work
on a device that queues kernels (:meth:`~.calibration.StepCalibration.elementwise_seconds`).

A Hugging Face layer runs norms (in float32 under autocast), activations, residual adds, rotary embeddings, casts,
gradient accumulation and the views between them; each is one or a few memory-bound passes over a ``[s, b, h]``,
``[s, b, f]`` or ``[b, heads, s, s]`` tensor, and each operator costs a dispatch (Python, autograd, the kernel launch
on a GPU). On a tiny model's CPU step they were 19 % of the operator time, unpriced (``docs/plan.md``).

:class:`OperatorCounter` (a ``TorchDispatchMode``) sees every ATen operator below autograd, forward and backward
(recomputed forwards included), and adds up one dispatch for each and, for each that is not a GEMM or an attention
kernel (whose device time their own measured rates price), the bytes of its tensor inputs and outputs; an operator
whose output is a view of its input (a view, an alias: no data moves) counts its dispatch only, an in-place one reads
and writes its tensor. A GEMM's launch costs the host what an add's does: counting element-wise operators alone divided
the calibration's measured chain (24 GEMMs in 132 operators) by 108 and charged a small Llama layer for 229 of its 256,
and a host-bound step on an H200 was priced at 1.43 × its measured time (1.27 counted whole, ``docs/gpus.md``).
Collectives are left out (their latency is priced apart), the mirrored ranks' too.

:func:`fit_work`: the probes of :mod:`.probe` (the layout's tp, sequence parallelism, recomputation, precision,
trained parts) run forward and backward with 3 layers and with 2; one layer's work is the difference, the rest (the
embedding, the final norm, the head and the loss) the 3-layer count less three layers. Operators per layer are a
constant of the family and layout; bytes are fitted over the activation terms (:data:`WORK_TERMS`, as
:data:`~.probe.TERMS`), the rest's over those outside the layers (:data:`REST_TERMS`, v the vocabulary: the embedding's
and the head's weight gradients are ``d·v``), with coefficients ``≥ 0``, and scaled to the full size.

A context-parallel layer runs its core attention block by block (:mod:`lightning_seqpar.context_parallel.attention`):
:func:`fit_context_work` counts that attention's own work on one of c ranks, its peers mirrored (the ring exchange
included), at the
model's heads and head size and small sequences, in place of the twin's explicit attention's ``s²`` terms.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_seqpar._compat import TorchDispatchMode, mutates_input
from lightning_seqpar.memory.tracker import operator_tensors

PRICED_APART = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "dot", "mv")
"""GEMMs (:meth:`~.calibration.StepCalibration.gemm_rate`); attention kernels are matched by their prefixes"""
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
_COLLECTIVES = ("c10d", "_c10d_functional", "_dtensor")


class OperatorCounter(TorchDispatchMode):
    """Counts, while active (``with OperatorCounter() as counter``) in this thread, the operators dispatched
    (:attr:`operators`, GEMMs and attention kernels included) and the bytes the element-wise ones read and write
    (:attr:`bytes`; see the module docstring). Everything run under :meth:`paused` is left out."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0
        self.bytes = 0
        self._paused = 0

    def paused(self) -> "_Paused":
        return _Paused(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self._paused or func.namespace in _COLLECTIVES:
            return out
        self.operators += 1
        if name in PRICED_APART or name.startswith(_ATTENTION):  # its dispatch only: FLOPs price its device time
            return out
        inputs = operator_tensors((args, kwargs))
        outputs = operator_tensors(out)
        storages = {_storage(t) for t in inputs}
        if mutates_input(func) or not any(_storage(t) in storages for t in outputs):
            self.bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, a wrapper): never shared
        return id(tensor)


class _Paused:
    def __init__(self, counter: OperatorCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.counter._paused += 1

    def __exit__(self, *exc: Any) -> None:
        self.counter._paused -= 1


_COLLECTIVE_METHODS = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_start", "reduce_scatter_start",
                       "broadcast", "all_to_all", "all_to_all_v", "ring_exchange_start")


def _uncounted_collectives(group: Any, counter: OperatorCounter) -> None:
    """``group``'s collectives (a mirrored rank's: torch operators standing in for its peers' tensors, which a real
    group's backend does) run with ``counter`` paused: set on this instance only."""
    for name in _COLLECTIVE_METHODS:
        method = getattr(group, name)

        def paused(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with counter.paused():
                return _method(*args, **kwargs)

        setattr(group, name, paused)


WORK_TERMS = ("bsd", "bsf", "bss", "bs", "ss", "sd", "dd", "df")  # as :data:`~.probe.TERMS`
REST_TERMS = ("bsd", "bsv", "bs", "sd", "ss", "dv", "bss")  # as :data:`~.probe.OUTSIDE_TERMS`
# (b, s, d, f, v) of the probes, s, f and v times t; the last checks the fit.
_PROBES = ((1, 8, 8, 16, 64), (2, 8, 8, 16, 96), (1, 16, 8, 16, 128), (1, 8, 16, 16, 64), (1, 8, 8, 32, 96),
           (2, 16, 8, 16, 64), (1, 16, 16, 16, 96), (1, 8, 16, 32, 128), (2, 8, 16, 32, 64), (2, 16, 16, 32, 128))


def _layer_terms(b: int, s: int, d: int, f: int) -> list[float]:
    return [b * s * d, b * s * f, b * s * s, b * s, s * s, s * d, d * d, d * f]


def _rest_terms(b: int, s: int, d: int, v: int) -> list[float]:
    return [b * s * d, b * s * v, b * s, s * d, s * s, d * v, b * s * s]


@dataclass(frozen=True)
class WorkFit:
    """Element-wise work of one micro-batch's forward and backward on one rank: per layer ``layer_operators``
    dispatches and ``Σ layer_bytes[k] · WORK_TERMS[k]`` bytes; outside the layers ``rest_operators`` and
    ``Σ rest_bytes[k] · REST_TERMS[k]`` (d values per head, f the MLP width, v the vocabulary); the fits' relative
    errors on the check probe."""

    layer_operators: float
    layer_bytes: tuple[float, ...]
    rest_operators: float
    rest_bytes: tuple[float, ...]
    check_error: tuple[float, float]

    def layer(self, s: int, b: int, head_dim: int, ffn: int, quadratic: bool = True) -> tuple[float, float]:
        """``(operators, bytes)`` of one layer; without ``quadratic``, less the ``s²`` terms (an explicit core
        attention's scores and softmax, which a context-parallel layer's blocks replace: :class:`ContextWork`)."""
        terms = _layer_terms(b, s, head_dim, ffn)
        return self.layer_operators, max(0.0, sum(c * x for c, x, name in zip(self.layer_bytes, terms, WORK_TERMS)
                                                  if quadratic or name not in ("bss", "ss")))

    def rest(self, s: int, b: int, head_dim: int, vocab: int) -> tuple[float, float]:
        """``(operators, bytes)`` outside the layers."""
        terms = _rest_terms(b, s, head_dim, vocab)
        return max(0.0, self.rest_operators), max(0.0, sum(c * x for c, x in zip(self.rest_bytes, terms)))


def count_step(config: Any, tp: int, sequence_parallel: bool, recompute: str, precision: str, s: int, b: int,
               overrides: Optional[dict] = None, layers: int = 3, modules: tuple[str, ...] = (),
               offload: tuple[str, ...] = (), training: Any = None, split: bool = False) -> tuple[int, int]:
    """``(operators, bytes)`` of one forward and backward (``model(input_ids=x, labels=x).loss.backward()``) of a
    ``layers``-layer small copy of ``config`` (:func:`~.probe.probe_model`) on rank 0 of ``tp`` ranks, its peers
    mirrored (:class:`~lightning_seqpar.parallel.mirrored.MirroredGroup`)."""
    from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules
    from lightning_seqpar.parallel.mirrored import MirroredGroup
    from lightning_seqpar.plan.measuring.probe import _DTYPES, probe_input, probe_model

    small, x = probe_input(config, tp, s, b, overrides, layers)
    group = MirroredGroup(tp)
    model = probe_model(small, _DTYPES[precision], group, sequence_parallel, recompute, modules, offload, training,
                        split)
    counter = OperatorCounter()
    _uncounted_collectives(group, counter)
    rules = cuda_autocast_rules() if precision == "bf16-mixed" else contextlib.nullcontext()
    with rules, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"), counter:
        model(input_ids=x, labels=x).loss.backward()
    return counter.operators, counter.bytes


def fit_work(config: Any, tp: int, sequence_parallel: bool = True, recompute: str = "selective",
             precision: str = "bf16-mixed", experts: Any = None, modules: tuple[str, ...] = (),
             offload: tuple[str, ...] = (), training: Any = None, split: bool = False) -> WorkFit:
    """:class:`WorkFit` of ``config``'s model under the layout (the arguments as :func:`~.probe.fit_layer`'s).

    Raises:
        ValueError: an unknown precision, or a layout the model refuses (from the rewrite).
    """
    from lightning_seqpar.hf.model_check import probe_head_dim
    from lightning_seqpar.plan.measuring.probe import _DTYPES, _expert_widths

    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: one of {sorted(_DTYPES)}.")
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    base = probe_head_dim(config)
    layer_rows, layer_bytes, rest_rows, rest_bytes, layer_ops, rest_ops = [], [], [], [], [], []
    for b, s, d, f, v in _PROBES:
        s, d, f, v = s * tp, d // 4 * base, f * tp, v * tp
        overrides = dict(head_dim=d, hidden_size=heads * d, n_embd=heads * d, intermediate_size=f, n_inner=f,
                         ffn_hidden_size=f, vocab_size=v)
        if experts is not None:
            overrides.update(_expert_widths(experts, f))
        three, two = (count_step(config, tp, sequence_parallel, recompute, precision, s, b, overrides, n, modules,
                                 offload, training, split) for n in (3, 2))
        layer = (three[0] - two[0], three[1] - two[1])
        layer_ops.append(layer[0])
        rest_ops.append(three[0] - 3 * layer[0])
        layer_rows.append(_layer_terms(b, s, d, f))
        layer_bytes.append(float(layer[1]))
        rest_rows.append(_rest_terms(b, s, d, v))
        rest_bytes.append(float(three[1] - 3 * layer[1]))
    layer_fit, layer_error = _nonnegative_fit(layer_rows, layer_bytes)
    rest_fit, rest_error = _nonnegative_fit(rest_rows, rest_bytes)
    return WorkFit(statistics.median(layer_ops), layer_fit, statistics.median(rest_ops), rest_fit,
                   (layer_error, rest_error))


def _nonnegative_fit(rows: list[list[float]], values: list[float]) -> tuple[tuple[float, ...], float]:
    """Coefficients ``≥ 0`` that give ``values`` from the terms ``rows`` (:func:`~.probe._least_squares` on all but
    the last probe, the most negative term dropped until none is), and the relative error on the last probe. A
    negative coefficient fits the probes' small sizes and turns the bytes negative at a long sequence (a ``b·s²`` term
    against ``b·s·d``)."""
    from lightning_seqpar.plan.measuring.probe import _least_squares

    active = list(range(len(rows[0])))
    while True:
        fitted, error = _least_squares([[row[i] for i in active] for row in rows], values)
        worst = min(range(len(active)), key=lambda i: fitted[i])
        if fitted[worst] >= 0 or len(active) == 1:
            break
        del active[worst]
    coefficients = [0.0] * len(rows[0])
    for i, c in zip(active, fitted):
        coefficients[i] = max(c, 0.0)
    return tuple(coefficients), error


_ELEMENT = {"32-true": torch.float32, "64-true": torch.float64, "bf16-true": torch.bfloat16,
            "bf16-mixed": torch.bfloat16}  # what q, k and v are in context-parallel attention (cast under autocast)


def count_context_attention(c: int, comm: str, heads: int, kv_heads: int, head_dim: int, b: int, s: int,
                            precision: str, fused: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((operators, bytes) forward, (operators, bytes) backward)`` of context-parallel core attention
    (:func:`~lightning_seqpar.context_parallel.attention.context_parallel_attention`, causal) on rank 0 of ``c``
    ranks, its peers mirrored: q ``[b, heads, s/c, head_dim]`` (a tensor-parallel rank's heads), k and v with
    ``kv_heads``. Its blocks' kernels (fused) or GEMMs are priced as attention FLOPs; what this counts is the rest: the
    log-sum-exp merges, the accumulators, the masks and softmax of op-by-op blocks."""
    from lightning_seqpar.context_parallel.attention import context_parallel_attention
    from lightning_seqpar.context_parallel.layout import ContextParallelBatch
    from lightning_seqpar.parallel.mirrored import MirroredGroup

    dtype, local = _ELEMENT[precision], s // c
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(b, n, local, head_dim, generator=generator).to(dtype)
                     for n in (heads, kv_heads, kv_heads, heads))

    group = MirroredGroup(c)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    layout = ContextParallelBatch(group, comm, s)
    forward, backward = OperatorCounter(), OperatorCounter()
    for counter in (forward, backward):
        _uncounted_collectives(group, counter)
    with forward:
        out = context_parallel_attention(*inputs, layout, head_dim ** -0.5, fused=fused)
    with backward:
        out.backward(grad)
    return (forward.operators, forward.bytes), (backward.operators, backward.bytes)


@dataclass(frozen=True)
class ContextWork:
    """Element-wise work of one layer's context-parallel core attention for one micro-batch on one rank:
    ``operators`` forward and backward (``forward_operators`` of them forward, counted again under full
    recomputation), and ``Σ bytes[k] · (b·s/c, b·(s/c)²)[k]`` bytes (``forward_bytes`` likewise)."""

    operators: float
    forward_operators: float
    bytes: tuple[float, float]
    forward_bytes: tuple[float, float]

    def layer(self, s_local: int, b: int, full: bool) -> tuple[float, float]:
        """``(operators, bytes)`` over ``s_local = s/c`` tokens; ``full``: the forward runs again in backward."""
        terms = (b * s_local, b * s_local * s_local)
        moved = sum(x * t for x, t in zip(self.bytes, terms)) + full * sum(
            x * t for x, t in zip(self.forward_bytes, terms))
        return self.operators + full * self.forward_operators, moved


_CONTEXT_PROBES = ((1, 16), (2, 16), (1, 32), (2, 32))  # (b, s/c)


def fit_context_work(c: int, comm: str, heads: int, kv_heads: int, head_dim: int, precision: str,
                     fused: bool) -> ContextWork:
    """:class:`ContextWork` from :func:`count_context_attention` at the model's heads and head size and small
    sequences (operators: a constant of c; bytes: ``b·s/c`` terms of the merges and accumulators and, op by op,
    ``b·(s/c)²`` ones of the blocks' scores), with coefficients ``≥ 0``.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in _ELEMENT:
        raise ValueError(f"precision={precision!r}: one of {sorted(_ELEMENT)}.")
    rows, total, forward, operators, forward_operators = [], [], [], [], []
    for b, n in _CONTEXT_PROBES:
        s = n * c
        (f_ops, f_bytes), (b_ops, b_bytes) = count_context_attention(c, comm, heads, kv_heads, head_dim, b, s,
                                                                     precision, fused)
        rows.append([b * n, b * n * n])
        total.append(float(f_bytes + b_bytes))
        forward.append(float(f_bytes))
        operators.append(f_ops + b_ops)
        forward_operators.append(f_ops)
    coefficients, _ = _nonnegative_fit(rows, total)
    forward_coefficients, _ = _nonnegative_fit(rows, forward)
    return ContextWork(statistics.median(operators), statistics.median(forward_operators), coefficients,
                       forward_coefficients)
