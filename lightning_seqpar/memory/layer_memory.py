"""One rewritten layer's memory policy: what it recomputes and what it offloads in backward, as one frozen value.

A layer holds one :class:`LayerMemory`, replaced whole by
:meth:`~lightning_seqpar.transformer.roles.ParallelLayer.set_memory`, which checks it against the layer first (a
module both recomputed and offloaded, a norm rebuilt in a post-norm block, a compiled body) and then hands the parts
inside the layer (core attention, the MLP slot) what they run. Megatron-Core reads the same choices from its
``TransformerConfig`` (``recompute_granularity``, ``recompute_modules``, ``fine_grained_activation_offloading``)
once per layer at build; here the callbacks choose them when fitting starts, so the value is made then, never
edited in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_seqpar.memory.conflicts import OffloadConflict, offload_conflict


@dataclass(frozen=True)
class LayerMemory:
    """What one rewritten layer trades for device memory in its backward.

    Attributes:
        whole: the layer runs inside a checkpoint (full recomputation, alone or in its stack's chunk): it keeps only
            its input, so nothing inside it is recomputed by module or offloaded.
        checkpoints_itself: the layer runs that checkpoint itself (it is not in a stack that checkpoints chunks).
        recompute: what it recomputes by module, :data:`~lightning_seqpar.memory.conflicts.RECOMPUTE_MODULES` names
            (``"full"`` aside): ``core_attn`` (selective recomputation), ``layernorm``, its MLP slot's kind (``mlp``
            or ``moe``), ``moe_act``, ``shared_experts``; only names the layer has a part for.
        offload: a :class:`~lightning_seqpar.offload.apply.LayerOffload` (the modules whose saved tensors go to host
            memory and the rank's pool), or ``None``.
    """

    whole: bool = False
    checkpoints_itself: bool = False
    recompute: frozenset[str] = field(default_factory=frozenset)
    offload: Optional[Any] = None

    def replace(self, **changes: Any) -> "LayerMemory":
        """This policy with ``changes``; a new value (the layer's is never edited in place)."""
        return replace(self, **changes)

    @property
    def offloaded(self) -> frozenset[str]:
        """The offloaded module names (empty without an offload, and inside a checkpoint, which keeps nothing)."""
        return frozenset() if self.offload is None or self.whole else frozenset(self.offload.names)

    @property
    def recomputed(self) -> frozenset[str]:
        """The modules recomputed by module (none inside a checkpoint: the layer is recomputed whole)."""
        return frozenset() if self.whole else self.recompute

    def conflict(self) -> Optional[OffloadConflict]:
        """A module both recomputed and offloaded (:data:`~lightning_seqpar.memory.conflicts.OFFLOAD_CONFLICTS`), or
        ``None``."""
        return offload_conflict(self.offloaded, self.recomputed)


NO_MEMORY_POLICY = LayerMemory()
"""Nothing recomputed, nothing offloaded: every layer's policy until a callback chooses one."""
