"""The modules an activation offload names (:data:`OFFLOAD_MODULES`), and which of them a recomputation leaves nothing
to offload: one table, read wherever the two choices meet (the memory model, the offload's budget plan, the planner's
rules and the check on a rewritten model).

A module recomputed in backward keeps only what its recomputation starts from (a checkpoint's input); offloading the
tensors it would have saved moves nothing, and offloading the input it rebuilds from moves what the device still needs.
Each :class:`OffloadConflict` names the offloaded modules, the recomputed one, why, and what to offload instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp", "expert_fc1", "moe_act")
"""The modules whose saved tensors :func:`~lightning_seqpar.offload.apply_offload` moves, in a layer's order, with
Megatron-Core's names where it has one: ``attn_norm`` (the layer's input, ``[s/t, b, h]`` under SP), ``qkv_linear``
(the attention norm's output), ``core_attn`` (q, k, v and, for the explicit core attention, the softmax output, dropout
mask and dropped probabilities, ``[b, a/t, s, s]``), ``attn_proj`` (the core attention's output ``[s, b, h/t]``),
``mlp_norm`` (the residual after attention), ``mlp`` (a dense MLP's input, its fc1 output and the activation's,
``[s, b, f/t]``), ``expert_fc1`` (the rows a rank's experts receive, ``[R, h]``), ``moe_act`` (the experts' gate and up
halves and the gate's activation, ``[R, f]`` each)."""

RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "shared_experts", "moe", "full")
"""The modules :func:`~lightning_seqpar.recompute.apply_recompute_modules` recomputes (Megatron-Core's
``recompute_modules`` names): the core attention (QKᵀ, softmax, dropout, ·V: the paper's selective recomputation), the
norms before attention and MLP (their outputs, ``[s/t, b, h]`` each, made again from their kept inputs when the input
projections' backward reads them; pre-norm blocks), a dense MLP (its inner ``[s, b, f/t]`` activations: the
all-gathered input, the fc1 outputs, the activation), the experts' activation (only the gate/up projection's output
kept: the activation and its output made again in backward), a mixture's shared expert (a dense MLP on every token: its
input kept), a mixture of experts (router, dispatch, experts, combine and shared expert run again in backward, their
all-to-alls included; only its input is kept), whole layers."""
BY_MODULE = tuple(m for m in RECOMPUTE_MODULES if m not in ("core_attn", "full"))
"""The modules recomputed by module beside a granularity (a layout's ``recompute_modules``): the core attention is
selective recomputation, ``full`` the full one."""

EXPERT_MODULES = ("expert_fc1", "moe_act")
DENSE_OFFLOAD_MODULES = tuple(m for m in OFFLOAD_MODULES if m not in EXPERT_MODULES)
"""The modules of a dense layer (what the memory model and the offload plan price)."""


@dataclass(frozen=True)
class OffloadConflict:
    """``offloaded`` (any of these offload modules) cannot go with ``recomputed`` (a module recomputed, by its
    ``SelectiveRecompute(modules=...)`` name, or ``core_attn`` by selective recomputation)."""

    offloaded: frozenset[str]
    recomputed: str
    why: str
    instead: str

    def message(self, offload: Iterable[str]) -> str:
        """The refusal, in the field's words: which offloaded modules, the recomputed one, why, and the fix."""
        named = sorted(set(offload) & self.offloaded)
        return (f"{', '.join(named)} both recomputed ({self.recomputed}) and offloaded: {self.why}. Offload "
                f"{self.instead} instead, or recompute without '{self.recomputed}'.")


OFFLOAD_CONFLICTS = (
    OffloadConflict(frozenset({"core_attn"}), "core_attn", "recomputed core attention keeps only q, k, v for its "
                    "checkpoint", "'qkv_linear' or 'attn_proj'"),
    OffloadConflict(frozenset({"mlp"}), "mlp", "recomputation keeps only the MLP's input", "'mlp_norm'"),
    OffloadConflict(frozenset({"attn_norm", "mlp_norm"}), "layernorm", "the norms' outputs are rebuilt from their "
                    "inputs, which stay on the device", "'qkv_linear' or 'mlp'"),
    OffloadConflict(frozenset({"expert_fc1", "moe_act"}), "moe", "recomputation keeps only the mixture's input",
                    "'mlp_norm'"),
    OffloadConflict(frozenset({"moe_act"}), "moe_act", "recomputation keeps only the experts' gate/up output",
                    "'expert_fc1'"),
)
"""Every conflict between an offloaded module and a recomputed one (recomputation under ``full`` keeps a layer's input
only: the callers refuse any offload there before reading this)."""


def recomputed_modules(recompute: str, modules: Sequence[str], cp: int = 1, eager_attention: bool = True) -> set[str]:
    """The modules a layer recomputes: ``modules`` (by module), and ``core_attn`` under selective recomputation where
    core attention is explicit (an eager attention, not under context parallelism, whose blockwise attention keeps no
    ``s²`` tensor to recompute)."""
    recomputed = set(modules)
    if recompute == "selective":
        recomputed.add("core_attn")
    if cp > 1 or not eager_attention:
        recomputed.discard("core_attn")
    return recomputed


def offload_conflict(offload: Iterable[str], recomputed: Iterable[str]) -> Optional[OffloadConflict]:
    """The first of :data:`OFFLOAD_CONFLICTS` that ``offload`` (offloaded modules) and ``recomputed`` (from
    :func:`recomputed_modules`, or read from a rewritten layer) meet, or ``None``."""
    offloaded, again = set(offload), set(recomputed)
    return next((c for c in OFFLOAD_CONFLICTS if c.recomputed in again and c.offloaded & offloaded), None)
