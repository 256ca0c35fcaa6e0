"""The MLP slot of the parallel block, and the dense MLP that fills it: its declaration (:class:`DenseMLPSpec`) and
what it builds (:class:`DenseMLPPart`): norm → column-parallel input projection(s) → activation → row-parallel output.

Megatron-Core's ``MLPSubmodules`` (``linear_fc1``, ``linear_fc2``). The slot is whatever ``BlockSpec.mlp`` builds
(``spec.build(builder)``): a dense MLP here; a mixture of experts in :mod:`.moe_part`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.tensor_parallel.layers import column_parallel_linears
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.part_builder import PartBuilder
from lightning_seqpar.transformer.paths import out_features, resolve
from lightning_seqpar.transformer.roles import require_divisible


@dataclass(frozen=True)
class DenseMLPSpec:
    """Which submodules of a block make its dense MLP (dotted paths inside the block).

    Attributes:
        mlp_norm: the norm before the MLP (joins the sequence-parallel region); ``None``: none.
        mlp_out: the output projection (``nn.Linear``, row-parallel).
        activation: the path of the activation (a module or a function attribute), or ``"F.<name>"``.
        mlp_in: the input projection (column-parallel); or
        gate, up: a gated MLP, ``act(gate(x)) · up(x)`` (SwiGLU; column-parallel, one all-gather); or
        gate_up: the two fused as ``[gate; up]`` (Phi-3, GLM), split per rank as ``[gate_r; up_r]``.
        mlp_dropout: an ``nn.Dropout`` between the activation and ``mlp_out`` (on ``[s, b, ffn/t]``: each rank draws
            its own mask).
        mlp_post_norm: a norm on the MLP output before the residual (Gemma 2/3); sequence-parallel.
    """

    mlp_norm: Optional[str]
    mlp_out: str
    activation: str
    mlp_in: Optional[str] = None
    gate: Optional[str] = None
    up: Optional[str] = None
    gate_up: Optional[str] = None
    mlp_dropout: Optional[str] = None
    mlp_post_norm: Optional[str] = None

    def inputs(self) -> list[str]:
        """The column-parallel input projections' paths (one all-gather for all)."""
        if self.mlp_in:
            return [self.mlp_in]
        return [self.gate_up] if self.gate_up else [p for p in (self.gate, self.up) if p]

    @property
    def gated(self) -> bool:
        """``act(gate(x)) · up(x)``."""
        return len(self.inputs()) == 2 or bool(self.gate_up)

    def paths(self) -> dict[str, str]:
        """Every submodule path the part names, by role."""
        named = {role: p for role, p in (("mlp_norm", self.mlp_norm), ("mlp_out", self.mlp_out)) if p}
        named.update({f"mlp input {i}": p for i, p in enumerate(self.inputs())})
        named.update({role: p for role, p in (("mlp_dropout", self.mlp_dropout), ("mlp_post_norm", self.mlp_post_norm))
                      if p})
        return named

    def linears(self) -> list[str]:
        """The paths that must be ``nn.Linear`` (or ``[in, out]`` Conv1D weights in a transposed block)."""
        return [*self.inputs(), self.mlp_out]

    def row_linears(self) -> list[str]:
        """The row-parallel projections' paths."""
        return [self.mlp_out]

    def check_declaration(self, name: str) -> None:
        """Raises ``ValueError`` unless exactly one kind of input is declared (``mlp_in``, ``gate`` and ``up``, or
        ``gate_up``)."""
        kinds = [bool(self.mlp_in), bool(self.gate or self.up), bool(self.gate_up)]
        if sum(kinds) != 1 or (kinds[1] and not (self.gate and self.up)):
            raise ValueError(f"{name}: declare the MLP input as mlp_in='...', as gate= and up= (both), or as gate_up= "
                             f"(fused).")

    def check_split(self, block: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Raises ``ValueError`` when the MLP width does not split over tp."""
        width = out_features(resolve(block, self.inputs()[0])) // (2 if self.gate_up else 1)
        require_divisible(name, "the MLP width", width, ctx.tp)

    def describe(self, block: nn.Module, ctx: RewriteContext) -> str:
        """What :func:`~lightning_seqpar.explain` says of the MLP."""
        return f"{'/'.join(self.inputs())} column-parallel, {self.mlp_out} row-parallel"

    def build(self, builder: PartBuilder) -> "DenseMLPPart":
        return DenseMLPPart(self, builder)


class DenseMLPPart:
    """The dense MLP of one parallel block, built from a :class:`DenseMLPSpec`; its modules are registered on the
    block under the user's paths. An :class:`~lightning_seqpar.transformer.mlp_slot.MLPSlot`: the block's
    ``mlp_offload`` region and module recomputation (``"mlp"``) cover all of it.

    Shapes: ``forward(x)`` ``[s/t, b, h]`` (SP) or ``[s, b, h]`` in and out; ``[s, b, ffn/t]`` inside.
    """

    kind = "mlp"
    recompute_modules: tuple[str, ...] = ("mlp",)
    offload_modules: tuple[str, ...] = ("mlp",)

    def __init__(self, spec: DenseMLPSpec, builder: PartBuilder) -> None:
        ctx = builder.ctx
        self.spec, self.group, self.sp = spec, ctx.group, ctx.sp
        self.inputs = tuple(builder.column(p, "mlp input", 2 if spec.gate_up else 1) for p in spec.inputs())
        self.out = builder.row(spec.mlp_out, "mlp out")
        self.norm = builder.norm(spec.mlp_norm, "mlp norm")
        self.post_norm = builder.norm(spec.mlp_post_norm, "mlp post norm")
        self.activation = builder.activation(spec.activation)
        self.inner_dropout = None if not spec.mlp_dropout else builder.host_module("mlp_inner_dropout", ParallelDropout(
            builder.resolve(spec.mlp_dropout).p, ctx.rng_tracker, sharded=ctx.tp > 1), "mlp inner dropout")
        self.ffn_hidden_size = builder.out_features(spec.inputs()[0]) // (2 if spec.gate_up else 1)

    def mixture_shape(self, bytes_per_element: int) -> None:
        return None

    def unpriced(self) -> str:
        return ""

    def not_compilable(self) -> str:
        return ""

    def recompute_within(self, names: Sequence[str]) -> int:
        return 0  # nothing inside a dense MLP is recomputed apart from it

    def offload_within(self, offloading: Optional[Callable[[str], Any]]) -> None:
        pass  # its one region is the block's

    def forward(self, x: Tensor, outputs: Optional[Sequence[Tensor]] = None) -> Tensor:
        """The MLP of the normed ``x`` (its input projections ``outputs`` when computed already: one all-gather with
        the attention's), through the output projection and the post-norm, if any."""
        if outputs is None:
            outputs = column_parallel_linears(x, list(self.inputs), self.group, self.sp)  # each [s, b, f/t]
        if self.spec.gate_up:  # fused [gate_r; up_r]
            outputs = outputs[0].chunk(2, dim=-1)
        inner = self.activation(outputs[0]) * outputs[1] if len(outputs) == 2 else self.activation(outputs[0])
        if self.inner_dropout is not None:
            inner = self.inner_dropout(inner)
        out = self.out(inner)
        return out if self.post_norm is None else self.post_norm(out)
