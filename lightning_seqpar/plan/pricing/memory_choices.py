"""What the planner says of recomputation by module and activation offload: their rules, the host memory and
host-link traffic of an offload, and the time that traffic adds to a step.

Offloaded tensors go out on a side stream while the forward computes and come back while the backward computes
(:mod:`lightning_seqpar.offload`), so a step waits on the host link only for what the compute does not cover: with
``T = bytes each way / host_bandwidth``, the forward (a third of the compute, Eq. 7's ``2 : 4`` split of forward and
backward FLOPs) hides ``T`` up to its length and the backward (two thirds) the same for the copies back:
``max(0, T − compute/3) + max(0, T − 2·compute/3)``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_seqpar.memory.conflicts import (
    DENSE_OFFLOAD_MODULES, EXPERT_MODULES, OFFLOAD_MODULES, offload_conflict, recomputed_modules,
)


TRADES = (
    (("layernorm",), ()),
    (("layernorm", "mlp"), ()),
    (("mlp",), ()),
    ((), ("attn_norm", "mlp_norm")),
    ((), ("mlp",)),
    ((), ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "mlp")),
    ((), DENSE_OFFLOAD_MODULES),
)
"""What the planner tries on a layout too large for the GPU (``memory_choices=True``), as ``(recomputed by module,
offloaded)``: the norms' outputs rebuilt (a norm's cost); with the MLP recomputed; the MLP recomputed; the norms' inputs
offloaded (the residual stream); the MLP's activations; every
module but core attention; every module."""


MIXTURE_TRADES = (
    (("layernorm",), ()),
    (("moe_act",), ()),
    (("layernorm", "moe"), ()),
    (("moe",), ()),
    ((), ("attn_norm", "mlp_norm")),
    ((), ("expert_fc1", "moe_act")),
    ((), ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")),
    ((), tuple(m for m in OFFLOAD_MODULES if m != "mlp")),
)
""":data:`TRADES` for a model whose MLPs are mixtures of experts: the experts' activation or the whole mixture
recomputed instead of the dense MLP, the experts' inputs offloaded instead of its activations."""


def trades(mixture: bool) -> tuple:
    """What the planner tries on a layout too large for the GPU: :data:`MIXTURE_TRADES` for a model with mixtures of
    experts, else :data:`TRADES`."""
    return MIXTURE_TRADES if mixture else TRADES


def memory_choice_rule(recompute: str, modules: tuple[str, ...], offload: tuple[str, ...], cp: int,
                       eager_attention: bool, mixture: bool = False) -> Optional[str]:
    """Why ``modules`` (recomputation by module beside ``recompute``) and ``offload`` cannot go together with the
    layout (``mixture``: the model's MLPs are mixtures of experts), in the field's words; ``None``: they can. (Their
    names are the :class:`~lightning_seqpar.Layout`'s to check.)"""
    dense_only = [m for m in (*modules, *offload) if m == "mlp"]
    experts_only = [m for m in (*modules, *offload) if m in ("moe", "moe_act", "shared_experts", *EXPERT_MODULES)]
    if mixture and dense_only:
        return "mlp names a dense MLP; this model's are mixtures of experts (recompute moe or moe_act, offload " \
               "expert_fc1 or moe_act)"
    if not mixture and experts_only:
        return f"{experts_only}: this model has no mixture of experts"
    if modules and recompute == "full":
        return "modules recomputed under full recomputation: a layer checkpointed whole keeps only its input, so " \
               "recomputing modules changes nothing"
    if offload and recompute == "full":
        return "offload under full recomputation: a layer checkpointed whole keeps only its input, nothing to offload"
    conflict = offload_conflict(offload, recomputed_modules(recompute, modules, cp, eager_attention))
    return None if conflict is None else conflict.message(offload)


def host_traffic(moved_per_layer: float, layers_per_rank: int, num_microbatches: int, held_layers: float,
                 compute: float, host_bandwidth: float) -> tuple[dict[str, float], float]:
    """``({"moved_per_step", "held"}, seconds)``: the bytes one rank copies to the host per step (and back), the bytes
    waiting there at its peak (``held_layers``: the layer-micro-batches in flight then), and the step time the
    copies add (the module docstring's rule; ``compute``: the step's compute seconds)."""
    moved = moved_per_layer * layers_per_rank * num_microbatches
    transfer = moved / host_bandwidth if moved else 0.0
    exposed = max(0.0, transfer - compute / 3) + max(0.0, transfer - 2 * compute / 3)
    return {"moved_per_step": moved, "held": moved_per_layer * held_layers}, exposed


def largest_offloaded_share(inventory: Any, s: int, b: int, t: int, record: Any, element: int, dropout: bool) -> float:
    """The largest of the offloaded modules' bytes over their sum (analytic terms, :func:`~.activations.layer_bytes`):
    a backward brings the offload back module by module and frees each module's share once its nodes have run."""
    from lightning_seqpar.plan.pricing.activations import offloaded_layer_bytes

    options = dict(sequence_parallel=True, recompute=record.layout.recompute, element=element, dropout=dropout,
                   modules=record.layout.recompute_modules)
    shares = [offloaded_layer_bytes(inventory, s, b, t, offload=(m,), **options) for m in record.layout.offload]
    return max(shares) / sum(shares) if sum(shares) else 0.0


def offload_backward_bytes(moved: float, kept: float, layers: int, share: float) -> float:
    """Bytes of offloaded activations on the device at the worst moment of a chunk's backward, beyond what the chunk
    keeps there (:mod:`lightning_seqpar.offload.host_pool`'s prefetch, one layer ahead).

    ``moved``: one layer's offloaded bytes; ``kept``: one layer's bytes left on the device; ``layers``: layers in the
    chunk; ``share``: the largest module's part of ``moved``. The chunk's top layer brings its copies back module by
    module (``share·moved`` at once) and, at its first read, the layer below whole (``moved``). Every lower layer is
    whole on the device at its first read, which fetches the next one: ``2·moved``, once the top layer's own ``kept``
    bytes are freed. A chunk of one layer prefetches nothing.
    """
    if layers <= 1:
        return share * moved
    return max((1 + share) * moved, 2 * moved - kept if layers > 2 else 0.0)


def describe(record: Any) -> str:
    """The memory choices of a layout record, as the planner's table prints them: ``selective``, ``none+mlp``,
    ``selective|offload attn_norm,mlp``."""
    text = record.layout.recompute + "".join(f"+{m}" for m in record.layout.recompute_modules)
    return text + (f"|offload {','.join(record.layout.offload)}" if record.layout.offload else "")
