"""This rank's experts: ``E/e`` gated MLPs held as packed 3-D weights, computed over rows grouped by expert.

The weights keep the layout of the model they come from, so state-dict shapes stay the user's:

- transformers 5.x's default (Qwen3-MoE, Mixtral, OLMoE, GLM-4.5): ``gate_up_proj`` ``[E, 2f, h]`` (gate rows, then
  up rows), ``down_proj`` ``[E, h, f]``, no biases;
- ``transposed`` (gpt-oss): ``gate_up_proj`` ``[E, h, 2f]``, ``down_proj`` ``[E, f, h]``; with ``bias``,
  ``gate_up_proj_bias`` ``[E, 2f]`` and ``down_proj_bias`` ``[E, h]``; how the ``2f`` outputs make the ``f`` gated
  ones (gpt-oss interleaves gate and up and clamps them) is the model's ``glu``.

Each is split along dim 0 over the expert-parallel ranks, each rank holding ``[E/e, …]`` (placed ``shard_over="ep"``,
replicated over expert data parallel ``edp``). Under expert tensor parallelism (``expert_tp`` = etp > 1, Megatron-Core's
``expert_tensor_parallel_size``) each expert's width f is split again over the ``etp`` ranks (``Placement.inner``):
``gate_up_proj`` keeps ``2f/etp`` of its outputs (``f/etp`` of each half, or a contiguous ``2f/etp`` where gate and
up interleave, gpt-oss), ``down_proj`` ``f/etp`` of its inputs; each rank computes every row of its experts on its
slice, and the slices' outputs add up to the expert's (the combine sums them). ``down_proj_bias`` is added by etp
rank 0 only, so the sum counts it once (its gradient summed over ``etp``: ``partial_over``).

The expert MLPs are grouped GEMMs: ``torch.nn.functional.grouped_mm`` where torch has a kernel for the operands (CUDA
and CPU, float32 and 16-bit, strides of 16-byte multiples; under autocast, in its dtype), and otherwise a loop over
the experts, one ``F.linear`` each (float64, unaligned widths). Both compute each expert's rows with its own weights;
an expert given no rows gets a zero gradient, not ``None``, either way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.memory.saved_tensors import Rebuild, saved_tensor_policy
from lightning_seqpar.moe.dispatch import check_expert_split, check_width_split
from lightning_seqpar.moe.expert_adapter import ExpertAdapter, adapted
from lightning_seqpar.moe.expert_product import expert_product
from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.layers import autocast_input
from lightning_seqpar.parallel.placement import ShardSpec, place
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupedExperts(nn.Module):
    """``E/e`` gated MLPs, ``down(glu(gate_up(x)))`` per expert; ``glu`` defaults to ``act(gate) · up`` over the two
    halves of the ``2f`` outputs (SwiGLU with SiLU).

    Args:
        num_experts: E, experts of the whole layer.
        hidden_size: h.
        intermediate_size: f, each expert's MLP width.
        expert_parallel: e, ranks the experts are split over (``E % e == 0``).
        activation: the gate's activation in the default ``glu``.
        dtype: the weights' dtype (default: torch's default dtype).
        transposed: weights stored ``[E, in, out]`` (gpt-oss) rather than ``[E, out, in]``.
        bias: a bias per expert and projection.
        glu: ``[R, 2f] → [R, f]``, replacing ``act(gate) · up`` (gpt-oss: interleaved, clamped, ``(up + 1)``).
        grouped_mm: use ``grouped_mm`` where it applies (``False``: always the loop).
        expert_tp: etp, ranks each expert's width is split over (``f % etp == 0``).
        etp_rank: this rank's slice of the width.
        interleaved: the ``2f`` outputs alternate gate and up (gpt-oss) rather than gate half, up half: an etp slice
            is then ``2f/etp`` contiguous outputs.

    Attributes:
        recompute_activation: keep only the gate/up projection's output ``[R, 2f]`` for backward: the activation is
            recomputed in its backward, and its output ``[R, f]`` (the down projection's input) made again when the down
            projection's backward reads it (recomputation by module, ``"moe_act"``; Megatron-Core's
            ``recompute_modules``, its ``CheckpointWithoutOutput``).
        offloading: ``offloading(module)``, a context for the region of ``"expert_fc1"`` (the gate/up projection: its
            input rows ``[R, h]``) or ``"moe_act"`` (the activation: the gate and up halves and the gate's activation)
            in which what autograd saves goes to host memory (set by :func:`lightning_seqpar.offload.apply_offload`);
            ``None``: nothing offloaded.
        gate_up_proj: ``[E/e, 2f, h]`` (``[E/e, h, 2f]`` transposed).
        down_proj: ``[E/e, h, f]`` (``[E/e, f, h]`` transposed).
        gate_up_proj_bias, down_proj_bias: ``[E/e, 2f]`` and ``[E/e, h]`` with ``bias``.
        weight_gradients: under a split schedule (ZB-H1, ZB-V, DualPipeV), the store the two projections leave their
            weight gradients in while it is deferring (:mod:`~lightning_seqpar.moe.expert_product`); ``None``: unsplit.

    Raises:
        ValueError: ``E`` not divisible by ``e``, or ``f`` by ``etp``.
    """

    recompute_activation: bool = False
    offloading: Optional[Callable[[str], Any]] = None
    weight_gradients: Optional[WeightGradientStore] = None  # the B/W split's store (split_weight_gradients)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, expert_parallel: int = 1,
                 activation: Optional[Callable[[Tensor], Tensor]] = F.silu, dtype: Optional[torch.dtype] = None, *,
                 transposed: bool = False, bias: bool = False,
                 glu: Optional[Callable[[Tensor], Tensor]] = None, grouped_mm: bool = True, expert_tp: int = 1,
                 etp_rank: int = 0, interleaved: bool = False) -> None:
        super().__init__()
        check_expert_split(num_experts, expert_parallel)
        check_width_split(intermediate_size, expert_tp)
        local = num_experts // expert_parallel
        self.num_experts, self.activation, self.transposed, self.glu = num_experts, activation, transposed, glu
        self.grouped_mm, self.intermediate_size = grouped_mm, intermediate_size
        self.expert_tp, self.etp_rank = expert_tp, etp_rank
        h, f2, f = hidden_size, 2 * intermediate_size // expert_tp, intermediate_size // expert_tp
        self.gate_up_proj = nn.Parameter(torch.empty(local, *((h, f2) if transposed else (f2, h)), dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(local, *((f, h) if transposed else (h, f)), dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, f2, dtype=dtype)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(local, h, dtype=dtype)) if bias else None
        split = ShardSpec(dim=0, full_size=num_experts, padded_size=num_experts)
        for weight in self.parameters():
            place(weight, shard=split, shard_over="ep", replicated_over="edp")
        if expert_tp > 1:  # each expert's width over etp: the gate/up outputs and the down projection's inputs
            width, halves = 2 * intermediate_size, 1 if interleaved else 2
            gate_up = ShardSpec(dim=2 if transposed else 1, full_size=width, padded_size=width, chunks=halves)
            place(self.gate_up_proj, inner=gate_up)
            place(self.down_proj, inner=ShardSpec(dim=1 if transposed else 2, full_size=intermediate_size,
                                                  padded_size=intermediate_size))
            if bias:
                place(self.gate_up_proj_bias, inner=ShardSpec(dim=1, full_size=width, padded_size=width, chunks=halves))
                place(self.down_proj_bias, partial_over=("etp",))

    def _down_bias(self) -> Optional[Tensor]:
        """``down_proj_bias``, or under expert tensor parallelism its share: all of it on etp rank 0, zeros elsewhere
        (a product, so every etp rank has a gradient to sum: the bias counted once in the slices' sum)."""
        bias = self.down_proj_bias
        if bias is None or self.expert_tp == 1:
            return bias
        return bias * (1.0 if self.etp_rank == 0 else 0.0)

    def weight_gradient_parameters(self) -> list[nn.Parameter]:
        """The weights whose gradient a split backward leaves to W (``split_weight_gradients``): the two projections';
        the biases' stay in B."""
        return [self.gate_up_proj, self.down_proj]

    def forward(self, rows: Tensor, tokens_per_expert: Sequence[int], counts: Optional[Tensor] = None,
                adapters: Sequence[ExpertAdapter] = ()) -> Tensor:
        """``rows`` ``[R, h]`` grouped by local expert (``tokens_per_expert[i]`` rows for expert i, in order) →
        ``[R, h]``. ``counts``: the same sizes as a device tensor ``[E/e]`` (the grouped GEMM's offsets come from it
        without a host-to-device copy). ``adapters``: LoRA adapters on the packed projections
        (:mod:`~lightning_seqpar.moe.expert_adapter`), at most one per projection."""
        by_name = {adapter.parameter_name: adapter for adapter in adapters}
        if self._grouped(rows, adapters):
            if counts is None:
                counts = torch.tensor(list(tokens_per_expert), device=rows.device)
            return self._grouped_forward(rows, counts, sum(tokens_per_expert), by_name)
        if self.weight_gradients is not None or by_name:
            return self._product_loop_forward(rows, list(tokens_per_expert), by_name)
        outputs, down_bias = [], self._down_bias()
        for i, chunk in enumerate(rows.split(list(tokens_per_expert))):
            with self._region("expert_fc1"):
                gate_up = _linear(chunk, self.gate_up_proj[i], _at(self.gate_up_proj_bias, i), self.transposed)
            hidden, rebuild = self._activated(gate_up)
            with saved_tensor_policy(rebuild, None) if rebuild is not None else contextlib.nullcontext():
                outputs.append(_linear(hidden, self.down_proj[i], _at(down_bias, i), self.transposed))
        return torch.cat(outputs) if outputs else rows

    def _product_loop_forward(self, rows: Tensor, sizes: list[int], adapters: dict[str, ExpertAdapter]) -> Tensor:
        """The loop's computation, one product per projection over every expert's rows (:mod:`.expert_product`):
        each weight gradient left to W under a split backward, the biases' in B; the adapters' products added."""
        store = self.weight_gradients
        with self._region("expert_fc1"):
            gate_up = expert_product(rows, self.gate_up_proj, self.transposed, store, sizes=sizes,
                                     bias=self.gate_up_proj_bias)
            gate_up = adapted(gate_up, rows, adapters.get("gate_up_proj"), store, sizes=sizes)
        hidden, rebuild = self._activated(gate_up)
        with saved_tensor_policy(rebuild, None) if rebuild is not None else contextlib.nullcontext():
            out = expert_product(hidden, self.down_proj, self.transposed, store, sizes=sizes, bias=self._down_bias())
            return adapted(out, hidden, adapters.get("down_proj"), store, sizes=sizes)

    def _activated(self, gate_up: Tensor) -> tuple[Tensor, Optional[Rebuild]]:
        """The activation of ``gate_up`` and, under :attr:`recompute_activation`, how to make it again (the output
        cast as the down projection reads it: the cast is what it keeps)."""
        if not (self.recompute_activation and torch.is_grad_enabled()):
            with self._region("moe_act"):
                return self._gate(gate_up).contiguous(), None
        hidden = recomputed(self._projected_gate, gate_up)  # the activation keeps only its input
        return hidden, Rebuild(hidden, self._projected_gate, gate_up)

    def _region(self, module: str) -> Any:
        return self.offloading(module) if self.offloading is not None else contextlib.nullcontext()

    def _projected_gate(self, gate_up: Tensor) -> Tensor:
        return autocast_input(self._gate(gate_up)).contiguous()

    def _gate(self, gate_up: Tensor) -> Tensor:
        if self.glu is not None:
            return self.glu(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        assert self.activation is not None, "the experts have neither an activation nor a glu"
        return self.activation(gate) * up

    def _grouped(self, rows: Tensor, adapters: Sequence[ExpertAdapter] = ()) -> bool:
        """Whether ``grouped_mm`` has a kernel for these operands (:meth:`uses_grouped_gemm`), the adapters' rank
        among them."""
        dtype = _compute_dtype(rows)
        size = torch.empty((), dtype=dtype).element_size()
        return rows.shape[0] > 0 and self.uses_grouped_gemm(dtype) and all(
            (adapter.rank * size) % 16 == 0 for adapter in adapters)

    def uses_grouped_gemm(self, dtype: torch.dtype) -> bool:
        """Whether rows computed in ``dtype`` take the grouped GEMM (its dtypes, the weights' too; every stride a
        16-byte multiple) rather than the loop over experts."""
        if not self.grouped_mm or not hasattr(F, "grouped_mm"):
            return False
        size = torch.empty((), dtype=dtype).element_size()
        widths = (*self.gate_up_proj.shape[1:], *self.down_proj.shape[1:])
        return dtype in _GROUPED_DTYPES and self.gate_up_proj.dtype in _GROUPED_DTYPES and all(
            (w * size) % 16 == 0 for w in widths)

    def _grouped_forward(self, rows: Tensor, counts: Tensor, total: int, adapters: dict[str, ExpertAdapter]) -> Tensor:
        dtype = _compute_dtype(rows)  # grouped_mm takes no part in autocast: cast as F.linear would under it
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        store = self.weight_gradients
        with torch.autocast(rows.device.type, enabled=False):
            with self._region("expert_fc1"):
                rows = rows.to(dtype)
                gate_up = self._grouped_linear(rows, self.gate_up_proj, offsets, dtype)
                gate_up = adapted(gate_up, rows, adapters.get("gate_up_proj"), store, offsets=offsets, dtype=dtype)
                if self.gate_up_proj_bias is not None:
                    gate_up = gate_up + self.gate_up_proj_bias.to(dtype).repeat_interleave(counts, 0,
                                                                                           output_size=total)
            hidden, rebuild = self._activated(gate_up)
            with saved_tensor_policy(rebuild, None) if rebuild is not None else contextlib.nullcontext():
                out = self._grouped_linear(hidden, self.down_proj, offsets, dtype)
                out = adapted(out, hidden, adapters.get("down_proj"), store, offsets=offsets, dtype=dtype)
            if self.down_proj_bias is not None:
                out = out + self._down_bias().to(dtype).repeat_interleave(counts, 0, output_size=total)
        return _ContiguousGradient.apply(out)


    def _grouped_linear(self, rows: Tensor, weight: Tensor, offsets: Tensor, dtype: torch.dtype) -> Tensor:
        if self.weight_gradients is not None:  # the weight gradient left to W
            return expert_product(rows, weight, self.transposed, self.weight_gradients, offsets=offsets, dtype=dtype)
        return _grouped_linear(rows, weight.to(dtype), offsets, self.transposed)


def glu_layout(glu: Callable[[Tensor], Tensor], width: int, expert_tp: int, name: str) -> str:
    """How a model's own gating function reads its ``2f`` gate/up outputs, found by running it: ``"halves"`` (gate
    then up, transformers' default) or ``"interleaved"`` (alternating, gpt-oss), whichever makes a slice of the
    width from the matching slice of the outputs; what an expert's split over ``expert_tp`` ranks must keep together.

    Raises:
        ValueError: neither does (the gating mixes the width), naming the part and the fix.
    """
    part = width // expert_tp
    with torch.no_grad():
        x = torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
        whole = glu(x)[:, :part]
        if torch.allclose(glu(torch.cat([x[:, :part], x[:, width:width + part]], dim=1)), whole):
            return "halves"
        if torch.allclose(glu(x[:, :2 * part]), whole):
            return "interleaved"
    raise ValueError(f"{name}: the experts' gating function makes each of the f outputs from more than its own gate "
                     f"and up value, so the width cannot split over expert_tp={expert_tp} ranks. Use expert_tp=1.")


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: grouped_mm's backward refuses an expanded one (a
    ``.sum()`` straight after the experts gives strides of 0)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _compute_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _at(bias: Optional[Tensor], i: int) -> Optional[Tensor]:
    return None if bias is None else bias[i]


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    """One expert's projection: ``x @ W (+ b)`` for ``[in, out]`` weights, ``F.linear`` for ``[out, in]``."""
    if transposed:
        return x @ weight if bias is None else torch.addmm(bias, x, weight)
    return F.linear(x, weight, bias)


def _grouped_linear(rows: Tensor, weight: Tensor, offsets: Tensor, transposed: bool) -> Tensor:
    """Every expert's projection of its rows in one grouped GEMM: ``grouped_mm`` takes ``[E, in, out]``."""
    return F.grouped_mm(rows, weight if transposed else weight.transpose(-2, -1), offs=offsets)
