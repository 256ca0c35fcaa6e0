"""What a part of the parallel block builds with: the user's block it reads, the parallel block it registers
modules on (under the user's paths, so state-dict keys stay the user's), and the rewrite context.

One :class:`PartBuilder` serves every part of a block (attention, MLP, and the block's own norms and dropouts), so
the rules are written once: a projection becomes column- or row-parallel (``Conv1D``-style ``[in, out]`` weights when
the block is declared ``transposed``; a PEFT LoRA layer keeps its adapters, :mod:`.lora`), a norm joins the
sequence-parallel region (its weights tagged sequence-parallel under SP).

Modules are registered on the parallel block when the block is complete (:meth:`PartBuilder.finish`), in the order of
:data:`ORDER`, whichever part built them first: the block's parameters keep the order they have always had (a
full-format checkpoint records optimizer state by parameter position).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch.nn as nn

from lightning_seqpar.tensor_parallel.layers import ColumnParallelInProjection, ColumnParallelLinear, RowParallelLinear
from lightning_seqpar.tensor_parallel.sharding import mark_sequence_parallel
from lightning_seqpar.transformer.paths import out_features, resolve, rotary_of, value_of
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.lora import column_with_lora, row_with_lora
from lightning_seqpar.transformer.tuner_layers import linear_of

ORDER = ("attention input", "mlp input", "attention out", "mlp out", "attention norm", "mlp norm", "attention post norm",
         "mlp post norm", "q norm", "k norm", "activation", "core attention", "attention residual dropout", "mlp residual dropout",
         "mlp inner dropout", "router", "experts", "shared expert gate", "attention sinks")
"""The roles of a block's modules in the order they are registered on it."""


class PartBuilder:
    """Builds the modules of a block's parts (see the module).

    Args:
        block: the user's single-device block (its norms and activation modules are reused, its weights sliced).
        host: the parallel block the modules are registered on.
        ctx: the rewrite context (tensor-parallel group, SP, dropout streams, context parallelism).
        name: the parallel block's name in messages.
        transposed: the block's projections store ``[in, out]`` weights (Hugging Face's ``Conv1D``).
    """

    def __init__(self, block: nn.Module, host: nn.Module, ctx: RewriteContext, name: str, transposed: bool) -> None:
        self.block, self.host, self.ctx, self.name = block, host, ctx, name
        self._pending: list[tuple[int, str, Union[nn.Module, nn.Parameter], bool]] = []
        self._column = ColumnParallelLinear.from_conv1d if transposed else ColumnParallelLinear.from_linear
        self._row = RowParallelLinear.from_conv1d if transposed else RowParallelLinear.from_linear

    def resolve(self, path: str) -> Any:
        """The user's submodule or attribute at ``path``."""
        return resolve(self.block, path)

    def value(self, spec_value: Union[int, float, str, None]) -> Any:
        """A declared value: as given, or the attribute a string names."""
        return value_of(self.block, spec_value)

    def out_features(self, path: str) -> int:
        """Output features of the projection at ``path``."""
        return out_features(self.resolve(path))

    def place(self, path: str, module: nn.Module, role: str) -> nn.Module:
        """``module`` goes on the parallel block at the user's ``path`` (containers created as needed), in ``role``'s
        turn (:data:`ORDER`)."""
        self._pending.append((ORDER.index(role), path, module, True))
        return module

    def place_parameter(self, path: str, parameter: nn.Parameter, role: str) -> nn.Parameter:
        """A parameter of the user's block (gpt-oss's attention sinks) goes on the parallel block at ``path``."""
        self._pending.append((ORDER.index(role), path, parameter, True))
        return parameter

    def host_module(self, name: str, module: nn.Module, role: str) -> nn.Module:
        """A module the parallel block adds (core attention, dropouts) goes on it under ``name``, in ``role``'s turn."""
        self._pending.append((ORDER.index(role), name, module, False))
        return module

    def finish(self) -> None:
        """Register every module placed, in :data:`ORDER` (stable within a role)."""
        for _, path, module, nested in sorted(self._pending, key=lambda entry: entry[0]):
            parent, _, name = path.rpartition(".") if nested else ("", "", path)
            target = self.host
            for part in filter(None, parent.split(".")):
                if not hasattr(target, part):
                    target.add_module(part, nn.Module())
                target = getattr(target, part)
            if isinstance(module, nn.Parameter):
                target.register_parameter(name, module)
            else:
                target.add_module(name, module)
        self._pending.clear()

    def column(self, path: str, role: str, chunks: Any = 1) -> nn.Module:
        """The column-parallel version of the projection at ``path`` (``chunks``: stacked blocks split separately)."""
        found = self.resolve(path)
        if isinstance(found, nn.MultiheadAttention):
            return self.place(path, ColumnParallelInProjection(found, self.ctx.group), role)
        base = self._column(linear_of(found), self.ctx.group, sequence_parallel=self.ctx.sp, chunks=chunks)
        return self.place(path, column_with_lora(base, found, self.ctx, f"{self.name} {path}"), role)

    def row(self, path: str, role: str) -> nn.Module:
        """The row-parallel version of the projection at ``path``."""
        found = self.resolve(path)
        base = self._row(linear_of(found), self.ctx.group, sequence_parallel=self.ctx.sp)
        return self.place(path, row_with_lora(base, found, self.ctx, f"{self.name} {path}"), role)

    def norm(self, path: Optional[str], role: str) -> Optional[nn.Module]:
        """The user's norm at ``path`` (``None``: none), in the sequence-parallel region: on ``[s/t, b, h]`` shards
        under SP, its weights' gradients summed over tp."""
        if not path:
            return None
        norm = self.resolve(path)
        if self.ctx.sp:
            mark_sequence_parallel(norm)
        return self.place(path, norm, role)

    def rotary(self, rotary: Union[str, Callable[..., Any], None]) -> Optional[Callable[..., Any]]:
        """The declared rotary function: as given, or found by name in the block's own Python module."""
        return rotary_of(self.block, rotary)

    def activation(self, path: str) -> Callable[..., Any]:
        """The declared activation: ``"F.<name>"`` from ``torch.nn.functional``, else the block's attribute (a module
        is kept on the parallel block as ``activation``, as the single-device block holds it)."""
        import torch.nn.functional as F

        if path.startswith("F."):
            return getattr(F, path[2:])
        found = self.resolve(path)
        return self.host_module("activation", found, "activation") if isinstance(found, nn.Module) else found
