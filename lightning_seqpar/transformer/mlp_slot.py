"""What the runtime may ask of a parallel block's MLP slot, whichever part fills it.

Megatron-Core's ``ModuleSpec`` chooses the MLP class once, when the layer is built (a dense MLP, or an MoE layer:
``models/gpt/moe_module_specs.py``); after that, recomputation, offload, the memory model and compilation ask the part,
never its type. The slot is filled by :class:`~lightning_seqpar.transformer.mlp_part.DenseMLPPart` or
:class:`~lightning_seqpar.transformer.moe_part.MoEPart`; a layer that has no such slot answers ``None``
(:attr:`~lightning_seqpar.transformer.roles.ParallelLayer.mlp_slot`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.memory.mixture import MixtureShape


class MLPSlot(Protocol):
    """The MLP of one parallel block.

    Shapes: ``forward(x)`` ``[s/t, b, h]`` (sequence parallel) or ``[s, b, h]`` in and out.

    Attributes:
        kind: the name that recomputes the whole slot (Megatron-Core's ``recompute_modules``): ``"mlp"`` for a
            dense MLP, ``"moe"`` for a mixture of experts.
        recompute_modules: the names of :data:`~lightning_seqpar.memory.conflicts.RECOMPUTE_MODULES` that recompute
            something of this slot (its :attr:`kind`, and a mixture's ``moe_act`` and ``shared_experts``, the latter
            where it has a shared expert).
        offload_modules: the names of :data:`~lightning_seqpar.offload.OFFLOAD_MODULES` whose regions this slot runs:
            ``("mlp",)`` for a dense MLP, the experts' ``("expert_fc1", "moe_act")`` for a mixture.
        norm: the norm before the slot (``None``: none), run by the block.
        ffn_hidden_size: f, the MLP width a token goes through (a mixture: its k experts' and its shared expert's), for
            FLOPs and the memory model.
    """

    kind: str
    recompute_modules: tuple[str, ...]
    offload_modules: tuple[str, ...]
    norm: Optional[nn.Module]
    ffn_hidden_size: int

    def forward(self, x: Tensor, outputs: Optional[Sequence[Tensor]] = None) -> Tensor:
        """The slot's output for the normed ``x`` (``outputs``: its input projections, where computed already)."""

    def mixture_shape(self, bytes_per_element: int) -> Optional[MixtureShape]:
        """The memory model's sizes of a mixture of experts (balanced routing) for activations of
        ``bytes_per_element`` bytes; ``None`` for a dense MLP."""

    def unpriced(self) -> str:
        """What of this slot the memory model (:mod:`lightning_seqpar.memory.activations`) does not price, in words
        (``"a shared expert"``); ``""`` where it prices all of it."""

    def not_compilable(self) -> str:
        """Why a block holding this slot cannot run its body compiled whole, and the fix; ``""`` when it can."""

    def recompute_within(self, names: Sequence[str]) -> int:
        """Recompute, inside this slot, the parts ``names`` (of :attr:`recompute_modules`, the slot's :attr:`kind`
        excluded: the block recomputes the slot whole) and stop recomputing the others; ``()`` undoes all. Returns how
        many it set."""

    def offload_within(self, offloading: Optional[Callable[[str], Any]]) -> None:
        """Run the regions of :attr:`offload_modules` that lie in this slot's own modules (a mixture's experts) under
        ``offloading(name)`` (the block's :meth:`~lightning_seqpar.transformer.roles.ParallelLayer.offloading`), or
        ``None``: no hooks."""
