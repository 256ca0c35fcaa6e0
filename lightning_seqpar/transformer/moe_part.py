"""The MLP slot filled by a mixture of experts: its declaration (:class:`MoESpec`) and what it builds
(:class:`MoEPart`): norm → router → dispatch over the expert-parallel group → this rank's experts → combine, plus an
optional shared expert (a dense MLP on every token, optionally gated).

Where each piece runs (Megatron-Core's ``MoELayer`` with its all-to-all dispatcher; Korthikanti et al. 2022 §4.2.2 for
the sequence-parallel region):

- the **router** runs in the sequence-parallel region, on this rank's ``[s/t·b, h]`` tokens (``s/(c·t)`` under
  context parallelism): it is the user's router module, called as the user's block calls it (its scoring, top-k,
  normalization, bias and scaling are the family's own), its weights summed over tp like a sequence-parallel norm's;
- the **experts** are split over the expert-parallel group (``[E/e, …]`` per rank,
  :class:`~lightning_seqpar.moe.experts.GroupedExperts`), and each expert's width over the expert tensor-parallel
  group (``f/etp``); each (token, expert) pair travels to its expert's rank (every etp rank of it:
  :func:`~lightning_seqpar.moe.dispatch.expert_tensor_parallel_pairs`) and back
  (:class:`~lightning_seqpar.moe.dispatch.TokenDispatcher` over the ``etp_ep`` group: one host read of the split sizes
  per layer call);
- the **shared expert** is a dense MLP part (column- then row-parallel, its own g and ḡ), its gate a linear map of the
  sequence-parallel tokens.

Under tensor parallelism without sequence parallelism every tp rank would hold every token and route it again, so the
expert's gradient would count each token t times: refused (Megatron-Core requires SP with TP for MoE as well).
"""

from __future__ import annotations

from dataclasses import dataclass
import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.memory.mixture import MixtureShape
from lightning_seqpar.moe.balancing import MARK, RouterTokens, SequenceParallelRows, UnmaskableRows
from lightning_seqpar.moe.capacity import CapacityDispatcher
from lightning_seqpar.moe.dispatch import TokenDispatcher, check_width_split, expert_tensor_parallel_pairs
from lightning_seqpar.moe.experts import GroupedExperts, glu_layout
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.parallel.placement import inner_spec
from lightning_seqpar.transformer.mlp_part import DenseMLPPart, DenseMLPSpec
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.expert_lora import expert_adapters, experts_with_lora
from lightning_seqpar.transformer.part_builder import PartBuilder
from lightning_seqpar.transformer.tuner_layers import linear_of
from lightning_seqpar.transformer.paths import resolve


_NEEDS_SP = ("{name}: a mixture of experts under tp={tp} needs sequence parallelism (each rank routes its own s/t "
             "tokens; without it every tp rank would route every token again): set sequence_parallel=True.")


@dataclass(frozen=True)
class MoESpec:
    """Which submodules of a block make its mixture of experts (dotted paths inside the block).

    Attributes:
        mlp_norm: the norm before the MLP (sequence-parallel region); ``None``: none.
        router: the router module: ``router(tokens [n, h]) → (logits [n, E], scores [n, k], experts [n, k])``, as every
            transformers 5.x router returns them, with its ``weight`` ``[E, h]``.
        experts: the experts module holding packed ``gate_up_proj`` ``[E, 2f, h]`` and ``down_proj`` ``[E, h, f]``
            (``[E, h, 2f]`` and ``[E, f, h]`` when ``transposed``), and optionally ``gate_up_proj_bias`` ``[E, 2f]``
            and ``down_proj_bias`` ``[E, h]``.
        activation: the path of the experts' activation (``act(gate) · up`` over the two halves); unused with ``glu``.
        glu: the path of the experts' gating function ``[R, 2f] → [R, f]`` where it is not ``act(gate) · up``
            (gpt-oss's ``_apply_gate``: interleaved gate/up, clamped, ``(up + 1) · gate · σ(α·gate)``); it is called
            with the experts module's plain attributes (``alpha``, ``limit``), never its weights.
        transposed: the packed weights are stored ``[E, in, out]`` (gpt-oss).
        shared: a dense MLP every token also goes through (Qwen2-MoE's ``shared_expert``, GLM-4.5's
            ``shared_experts``), declared without a norm of its own; ``None``: none.
        shared_gate: a ``Linear(h, 1)`` whose sigmoid scales the shared MLP's output per token (Qwen2-MoE).
        mlp_post_norm: a norm on the MLP output before the residual.
    """

    mlp_norm: Optional[str]
    router: str
    experts: str
    activation: Optional[str]
    shared: Optional[DenseMLPSpec] = None
    shared_gate: Optional[str] = None
    mlp_post_norm: Optional[str] = None
    glu: Optional[str] = None
    transposed: bool = False

    gated = True  # the experts are gated MLPs (the memory model's 3 matrices of width f)

    def inputs(self) -> list[str]:
        """No column-parallel input projection shares the attention's all-gather: the router reads local tokens."""
        return []

    def paths(self) -> dict[str, str]:
        """Every submodule path the part names, by role."""
        named = {role: p for role, p in (("mlp_norm", self.mlp_norm), ("router", self.router),
                                         ("experts", self.experts), ("shared_gate", self.shared_gate),
                                         ("mlp_post_norm", self.mlp_post_norm)) if p}
        if self.shared is not None:
            named.update({f"shared {role}": p for role, p in self.shared.paths().items()})
        return named

    def linears(self) -> list[str]:
        """The paths that must be ``nn.Linear``: the shared MLP's projections and its gate."""
        return [*(self.shared.linears() if self.shared is not None else []), *filter(None, [self.shared_gate])]

    def row_linears(self) -> list[str]:
        """The row-parallel projections' paths: the shared MLP's output."""
        return self.shared.row_linears() if self.shared is not None else []

    def check_declaration(self, name: str) -> None:
        """Raises ``ValueError`` on a shared MLP declared with a norm of its own (it reads the part's normed input)
        or declared wrongly (:meth:`DenseMLPSpec.check_declaration`)."""
        if self.shared is not None:
            if self.shared.mlp_norm or self.shared.mlp_post_norm:
                raise ValueError(f"{name}: the shared expert reads the mixture's normed input; declare its norms on "
                                 f"the MoESpec, not on the shared DenseMLPSpec.")
            self.shared.check_declaration(name)

    def check_split(self, block: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Raises ``ValueError``: experts that ``ep`` does not divide, more experts per token than experts, tp > 1
        without sequence parallelism, a shared MLP whose width tp does not divide, a LoRA adapter on the experts that
        the parallel experts do not train (:func:`~.expert_lora.expert_adapters`)."""
        expert_adapters(resolve(block, self.experts), f"{name} {self.experts}")  # what their LoRA cannot be
        experts = linear_of(resolve(block, self.experts))
        count = getattr(experts, "num_experts", None) or getattr(getattr(experts, "down_proj", None), "shape", [0])[0]
        if count % ctx.ep:
            raise ValueError(f"{name}: {count} experts do not split over ep={ctx.ep} ranks: choose ep among the divisors "
                             f"of {count}.")
        k = getattr(resolve(block, self.router), "top_k", None)
        if isinstance(k, int) and not 1 <= k <= count:
            raise ValueError(f"{name}: the router chooses {k} experts per token of {count}: experts per token "
                             f"(num_experts_per_tok) must lie in 1..{count}.")
        if ctx.tp > 1 and not ctx.sp:
            raise ValueError(_NEEDS_SP.format(name=name, tp=ctx.tp))
        if ctx.expert_tp > 1:
            down = experts.down_proj
            try:
                check_width_split(down.shape[1] if self.transposed else down.shape[2], ctx.expert_tp)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        if self.shared is not None:
            self.shared.check_split(block, ctx, name)

    def describe(self, block: nn.Module, ctx: RewriteContext) -> str:
        """What :func:`~lightning_seqpar.explain` says of the mixture: experts per rank, the groups, the dispatch."""
        count = linear_of(resolve(block, self.experts)).down_proj.shape[0]
        router = resolve(block, self.router)
        k = getattr(router, "top_k", None)
        width = "whole on each rank" if ctx.expert_tp == 1 else \
            f"each expert's width split over expert_tp={ctx.expert_tp} (tokens sent to every slice, outputs summed)"
        return (f"{count} experts ({self.experts}) → {count // ctx.ep} per rank over ep={ctx.ep}, {width}, "
                f"gradients averaged over expert data parallel; router {self.router}"
                f"{f' (top-{k})' if k else ''} on each rank's {'s/t·b' if ctx.sp else 's·b'} tokens "
                f"{'(sequence-parallel, weight summed over tp)' if ctx.sp else ''}; dispatch and combine by all-to-all "
                f"over {'ep' if ctx.expert_tp == 1 else 'etp·ep'} ({_dispatch_text(ctx)})"
                + _adapters_text(resolve(block, self.experts), ctx)
                + (f"; shared expert {self.shared.describe(block, ctx)}" if self.shared is not None else "")
                + (f", gated by {self.shared_gate}" if self.shared_gate else ""))

    def build(self, builder: PartBuilder) -> "MoEPart":
        return MoEPart(self, builder)


class MoEPart:
    """The mixture of experts of one parallel block, built from a :class:`MoESpec` (see the module docstring); its
    modules are registered on the block under the user's paths.

    Shapes: ``forward(x)`` ``[s/t, b, h]`` (SP) or ``[s, b, h]`` (t = 1) in and out; tokens ``[n, h]`` with
    ``n = s/t·b`` local to this rank; rows for the local experts ``[R, h]``, R the (token, expert) pairs routed here.

    An :class:`~lightning_seqpar.transformer.mlp_slot.MLPSlot`: recomputed whole (``"moe"``), or its experts'
    activation (``"moe_act"``) and shared expert (``"shared_experts"``) alone; its experts' regions offloaded.

    Raises:
        ValueError: tensor parallelism without sequence parallelism; experts whose count the expert-parallel size does
            not divide; an experts module that is not two packed 3-D weights.
    """

    kind = "moe"
    offload_modules: tuple[str, ...] = ("expert_fc1", "moe_act")

    def __init__(self, spec: MoESpec, builder: PartBuilder) -> None:
        ctx = builder.ctx
        self.spec, self.name = spec, builder.name
        if ctx.tp > 1 and not ctx.sp:
            raise ValueError(_NEEDS_SP.format(name=builder.name, tp=ctx.tp))
        self.norm = builder.norm(spec.mlp_norm, "mlp norm")
        self.post_norm = builder.norm(spec.mlp_post_norm, "mlp post norm")
        self.inputs: tuple[nn.Module, ...] = ()
        self.rng_tracker = ctx.rng_tracker
        self.recompute_shared = False  # the shared expert recomputed by module (modules=["shared_experts"])
        self.router = builder.resolve(spec.router)
        if ctx.sp:  # each tp rank routes its own tokens: the router's gradient is partial over tp
            for module in self.router.modules():  # a LoRA adapter PEFT put on the router's weight too
                mark_sequence_parallel(module)
        builder.place(spec.router, self.router, "router")
        group = ctx.expert_group if ctx.expert_group is not None else ParallelGroup()
        width = ctx.expert_tp_group if ctx.expert_tp_group is not None else ParallelGroup()
        self.experts = _local_experts(builder, spec, group, width)
        # The experts inside the LoRA adapters PEFT nested around them, if any: what the forward calls.
        self.adapted_experts = builder.place(spec.experts, experts_with_lora(
            self.experts, builder.resolve(spec.experts), group, width, f"{builder.name} {spec.experts}"), "experts")
        self.ep, self.expert_tp = group.size, width.size
        # Each (token, expert) pair goes to every slice of the expert's width: E·etp slices over the etp·ep ranks.
        over = ctx.expert_dispatch_group if width.size > 1 else group
        slices = self.experts.num_experts * width.size
        self.dispatcher = TokenDispatcher(over, slices) if ctx.dispatch.capacity_factor is None \
            else CapacityDispatcher(over, slices, ctx.dispatch)
        self.tokens = _router_tokens(ctx)
        self.last_logits: Optional[Tensor] = None  # kept for the pipeline's carrier only (tokens.stages)
        # The MLP width a token goes through, for FLOPs (FlopsUtilization) and the memory model: k experts of width f
        # (the router's top_k, where it names it), plus the shared MLP's.
        self.top_k = int(getattr(self.router, "top_k", 1) or 1)
        self.ffn_hidden_size = self.top_k * self.experts.intermediate_size
        self.shared: Optional[DenseMLPPart] = spec.shared.build(builder) if spec.shared is not None else None
        if self.shared is not None:
            self.ffn_hidden_size += self.shared.ffn_hidden_size
        self.shared_gate = None
        if spec.shared_gate:
            self.shared_gate = builder.resolve(spec.shared_gate)
            if ctx.sp:
                for module in self.shared_gate.modules():  # with a LoRA adapter PEFT put on it
                    mark_sequence_parallel(module)
            builder.place(spec.shared_gate, self.shared_gate, "shared expert gate")

    def mixture_shape(self, bytes_per_element: int) -> MixtureShape:
        """The memory model's sizes of this mixture (:class:`~lightning_seqpar.memory.mixture.MixtureShape`, balanced
        routing) for activations of ``bytes_per_element`` bytes (2: 16-bit, 4: float32, 8: float64; the grouped GEMM
        runs the first two)."""
        factor = self.dispatcher.config.capacity_factor if isinstance(self.dispatcher, CapacityDispatcher) else None
        dtype = {2: torch.bfloat16, 4: torch.float32}.get(bytes_per_element, torch.float64)
        return MixtureShape(self.experts.num_experts, self.top_k, self.experts.intermediate_size, self.ep,
                            self.expert_tp, grouped=self.experts.uses_grouped_gemm(dtype), capacity_factor=factor)

    @property
    def recompute_modules(self) -> tuple[str, ...]:
        return ("moe", "moe_act") + (("shared_experts",) if self.shared is not None else ())

    def unpriced(self) -> str:
        parts = []
        if self.shared is not None:
            parts.append("a shared expert")
        if self.adapted_experts is not self.experts:
            parts.append("LoRA on the experts (the rows their adapters keep)")
        return " and ".join(parts)

    def not_compilable(self) -> str:
        if not self.dispatcher.reads_sizes_on_host:
            return ""
        return ("holds a dropless mixture of experts, which is not compiled (its dispatch reads the split sizes on "
                "the host: a graph break): give the experts a capacity (moe=DispatchConfig(capacity_factor=...): "
                "fixed sizes, no host read), or train with compile=False")

    def recompute_within(self, names: Sequence[str]) -> int:
        self.experts.recompute_activation = "moe_act" in names
        self.recompute_shared = "shared_experts" in names and self.shared is not None
        return self.experts.recompute_activation + self.recompute_shared

    def offload_within(self, offloading: Optional[Callable[[str], Any]]) -> None:
        self.experts.offloading = offloading

    def forward(self, x: Tensor, outputs: Optional[Sequence[Tensor]] = None) -> Tensor:
        """The mixture of the normed ``x`` ``[s/t, b, h]``: each token's k experts' outputs weighted by the router's
        scores, plus the shared MLP's, then the post-norm, if any."""
        tokens = x.reshape(-1, x.shape[-1])  # [n, h], this rank's tokens
        logits, scores, chosen = self.router(tokens)
        setattr(logits, MARK, self.tokens)  # a load-balancing loss over these logits pools every rank's tokens
        if self.tokens.stages is not None and self.tokens.stages.collecting:  # read after the stage's forward
            self.last_logits = logits
        if self.expert_tp > 1:
            chosen, scores = expert_tensor_parallel_pairs(chosen, scores, self.experts.num_experts, self.ep,
                                                          self.expert_tp)
        rows, routing = self.dispatcher.dispatch(tokens, chosen, scores)
        computed = self.adapted_experts(rows, routing.tokens_per_expert, routing.expert_counts)
        # The experts saved what their backward reads (nothing of the rows when frozen), and the combine keeps only
        # the pairs' outputs: neither [R, h] needs to live on through the combine and the shared expert.
        del rows
        out = self.dispatcher.combine(computed, routing, scores).view(x.shape)
        del computed
        if self.shared is not None:
            if self.recompute_shared and torch.is_grad_enabled():  # its input kept, its inner activations made again
                shared = recomputed(self.shared.forward, x, rng_tracker=self.rng_tracker)
            else:
                shared = self.shared.forward(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out if self.post_norm is None else self.post_norm(out)


def _adapters_text(experts: nn.Module, ctx: RewriteContext) -> str:
    """What :func:`~lightning_seqpar.explain` says of LoRA on the experts: the weights adapted, how A and B split."""
    chain = expert_adapters(experts, "")
    if not chain:
        return ""
    width = "" if ctx.expert_tp == 1 else ", gate/up's B and down's A along the width over expert_tp"
    names = ", ".join(parts.parameter_name for parts in reversed(chain))
    return f"; LoRA r={chain[0].rank} on {names} (each expert's A and B with it over ep{width})"


def _dispatch_text(ctx: RewriteContext) -> str:
    factor = ctx.dispatch.capacity_factor
    if factor is None:
        return "dropless: one host read of the split sizes per layer call"
    return (f"capacity ⌈{factor}·n·k/E⌉ pairs per expert from each rank, the rest dropped by "
            f"{ctx.dispatch.drop_policy}, no host read")


def _router_tokens(ctx: RewriteContext) -> RouterTokens:
    """Where this rank's router rows come from: the ranks holding the step's other tokens, and how its rows read a
    ``[b, s]`` attention mask."""
    split = (ctx.group,) if ctx.sp else ()
    data = ctx.data_group if ctx.data_group is not None and ctx.data_group.size > 1 else None
    rows_of = SequenceParallelRows(ctx.group, ctx.sp) if ctx.cp == 1 else UnmaskableRows()
    replicas = data.size if data is not None else 1
    return RouterTokens(split + ((data,) if data is not None else ()), replicas // ctx.cp, ctx.cp, rows_of)


def _local_experts(builder: PartBuilder, spec: MoESpec, group: ParallelGroup, split: ParallelGroup) -> GroupedExperts:
    """This rank's ``E/e`` experts, sliced from the user's packed weights (and biases), each its ``f/etp`` slice of
    the width over ``split`` (the expert tensor-parallel group)."""
    experts = linear_of(builder.resolve(spec.experts))  # inside PEFT's adapters, if any: experts_with_lora
    weights = dict(experts.named_parameters(recurse=False))
    biases = {"gate_up_proj_bias", "down_proj_bias"} & set(weights)
    if set(weights) - biases != {"gate_up_proj", "down_proj"} or len(biases) == 1 or any(
            weights[n].dim() != 3 for n in ("gate_up_proj", "down_proj") if n in weights):
        raise ValueError(f"{builder.name}: the experts at {spec.experts} ({type(experts).__name__}) hold "
                         f"{ {n: tuple(w.shape) for n, w in weights.items()} }; the parallel experts take the packed "
                         f"gate_up_proj and down_proj of transformers 5.x ([E, 2f, h] and [E, h, f], or transposed), "
                         f"with both biases or none. Write a Policy for this block.")
    gate_up, down = weights["gate_up_proj"], weights["down_proj"]
    num_experts = down.shape[0]
    width, hidden = (down.shape[1], down.shape[2]) if spec.transposed else (down.shape[2], down.shape[1])
    activation = builder.resolve(spec.activation) if spec.activation else None
    glu = _detached(builder.resolve(spec.glu)) if spec.glu else None
    interleaved = glu is not None and split.size > 1 and glu_layout(glu, width, split.size, builder.name) == "interleaved"
    with gate_up.device:  # the meta device: a skeleton
        local = GroupedExperts(num_experts, hidden, width, group.size, activation, gate_up.dtype,
                               transposed=spec.transposed, bias=bool(biases), glu=glu, expert_tp=split.size,
                               etp_rank=split.rank, interleaved=interleaved)
    per_rank = num_experts // group.size
    for name, mine in local.named_parameters():
        full = weights[name]
        mine.requires_grad_(full.requires_grad)  # frozen experts (LoRA elsewhere, a frozen base) stay frozen
        if not full.is_meta:  # on the meta device: a skeleton, allocated and read later (Materializer.fill)
            with torch.no_grad():
                value = full.detach().narrow(0, group.rank * per_rank, per_rank)
                inner = inner_spec(mine)
                mine.data = (inner.shard(value, split) if inner is not None else value).clone()
    return local


def _detached(function: Callable[..., Any]) -> Callable[..., Any]:
    """A method of the user's experts module bound instead to its plain attributes and weightless submodules (the
    activation), so the parallel experts do not keep the whole ``[E, …]`` weights alive through it."""
    owner = getattr(function, "__self__", None)
    if not isinstance(owner, nn.Module):
        return function
    state = {k: v for k, v in vars(owner).items() if not k.startswith("_") and not isinstance(v, (Tensor, nn.Module))}
    state.update({k: m for k, m in owner.named_children() if next(m.parameters(), None) is None})
    return _BoundToState(function.__func__, types.SimpleNamespace(**state))


@dataclass(frozen=True)
class _BoundToState:
    """``function(state, x)``: a method called on a namespace of its module's attributes (a value: it pickles and
    copies with the model)."""

    function: Callable[..., Any]
    state: types.SimpleNamespace

    def __call__(self, x: Tensor) -> Tensor:
        return self.function(self.state, x)
