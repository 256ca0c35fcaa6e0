"""Which modules to offload for a byte budget: a pure function of the configuration, no warm-up iteration.

Offloading frees on the device exactly the bytes it moves (:func:`~lightning_seqpar.memory.activations.
offloaded_activation_terms`), so every choice that fits trades the same thing, host-link traffic, for memory: the plan
is the set of modules that fits with the fewest bytes moved. Under the pipeline a rank holds its layers' activations
for as many micro-batches as its schedule keeps in flight (:func:`~lightning_seqpar.pipeline_parallel.schedules.
simulate`: p − r for rank r under 1F1B), so ranks with fewer in flight offload less, each deciding from its own
count — every rank of a stage decides the same. A mixture of experts is priced with balanced routing (or its fixed
capacity): :mod:`lightning_seqpar.memory.mixture`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_seqpar.memory.activations import (Recompute, TransformerShape, layer_activation_terms,
                                                 offloaded_activation_terms)
from lightning_seqpar.memory.conflicts import (
    DENSE_OFFLOAD_MODULES, EXPERT_MODULES, OFFLOAD_MODULES, offload_conflict, recomputed_modules,
)
from lightning_seqpar.memory.mixture import MixtureShape


@dataclass(frozen=True)
class OffloadPlan:
    """The modules to offload and what that leaves (bytes, one rank, at its pipeline peak)."""

    modules: tuple[str, ...]
    """the chosen modules, in :data:`~lightning_seqpar.offload.OFFLOAD_MODULES`' order (empty: none needed)"""
    device_bytes: float
    """layer activations left on the device with ``in_flight`` micro-batches of ``layers`` layers held"""
    host_bytes: float
    """what waits in host memory then"""
    moved_per_micro_batch: float
    """bytes copied to the host by one micro-batch's forward through the rank's layers (and back in its backward)"""
    in_flight: int
    layers: int


def plan_offload(shape: TransformerShape, t: int, sequence_parallel: bool, budget: float, layers: int,
                 in_flight: int = 1, recompute: Recompute = "none", modules: Sequence[str] = (),
                 bytes_per_element: int = 2, mask_bytes: int = 1, c: int = 1,
                 norm_statistics_bytes: int = 0, keeps_output: bool = False,
                 experts: Optional[MixtureShape] = None, mixture_layers: Optional[int] = None) -> OffloadPlan:
    """The subset of the layers' offloadable modules whose layer activations fit ``budget`` bytes with the fewest bytes
    moved (ties: fewer modules, then the earlier modules); none when nothing needs to move. The modules are
    :data:`~lightning_seqpar.offload.DENSE_OFFLOAD_MODULES`; with ``experts``, the experts' ``expert_fc1`` and ``moe_act``
    too, and ``mlp`` only where no layer is a mixture (the offload refuses it there).

    Args:
        shape: s, b (the micro-batch), h, a, f.
        t, sequence_parallel, c, recompute, modules, bytes_per_element, mask_bytes, norm_statistics_bytes: as
            :func:`~lightning_seqpar.memory.activations.layer_activation_terms` (``modules``: recomputation by module;
            a module recomputed is not offloaded).
        budget: bytes of layer activations allowed on the device (all ``in_flight`` micro-batches).
        layers: transformer layers this rank holds (per model chunk times chunks).
        in_flight: micro-batches whose activations the rank holds at once (its schedule's peak; 1 without a pipeline).
        keeps_output: the rank sends its output to a later pipeline stage and keeps it for that micro-batch's backward;
            with ``attn_norm`` offloaded it is not a layer's offloaded input here: ``e·sbh/(t·c)`` (SP) per micro-batch
            in flight stays on the device.
        experts: the mixture of experts in the MLP place of ``mixture_layers`` of the ``layers`` (default: all of them;
            the others are dense, of width ``shape.f``).

    Raises:
        ValueError: ``budget`` not positive, ``layers`` or ``in_flight`` below 1, ``mixture_layers`` outside
            ``0..layers``, or no choice fits (naming the least it can leave and the fixes).
    """
    mixtures = (layers if mixture_layers is None else mixture_layers) if experts is not None else 0
    if budget <= 0 or layers < 1 or in_flight < 1 or not 0 <= mixtures <= layers:
        raise ValueError(f"budget must be > 0 bytes, layers and in_flight >= 1 and mixture_layers within 0..layers; "
                         f"got budget={budget}, layers={layers}, in_flight={in_flight}, mixture_layers={mixture_layers}.")
    options = dict(t=t, sequence_parallel=sequence_parallel, recompute=recompute, bytes_per_element=bytes_per_element,
                   mask_bytes=mask_bytes, c=c, norm_statistics_bytes=norm_statistics_bytes)
    kinds = [(count, kind) for count, kind in ((layers - mixtures, None), (mixtures, experts)) if count]
    names = DENSE_OFFLOAD_MODULES if not mixtures else tuple(m for m in OFFLOAD_MODULES if m != "mlp")
    again = recomputed_modules(recompute, modules, c)  # what they recompute has nothing to offload
    allowed = [m for m in names if offload_conflict([m], again) is None]

    def of(terms, chosen: Sequence[str]) -> float:  # bytes over the rank's layers, each kind with what applies to it
        return sum(count * sum(terms(shape, offload=_applying(chosen, kind), modules=_applying(modules, kind),
                                     experts=kind, **options).values()) for count, kind in kinds)

    output = bytes_per_element * shape.s * shape.b * shape.h / ((t if sequence_parallel else 1) * c)
    best = None
    for size in range(len(allowed) + 1):
        for chosen in itertools.combinations(allowed, size):
            left = in_flight * of(layer_activation_terms, chosen)
            if keeps_output and "attn_norm" in chosen and recompute != "full":
                left += in_flight * output
            moved = of(offloaded_activation_terms, chosen)
            if left <= budget and (best is None or moved < best.moved_per_micro_batch):
                best = OffloadPlan(chosen, left, in_flight * moved, moved, in_flight, layers)
    if best is None:
        least = in_flight * of(layer_activation_terms, allowed)
        raise ValueError(f"No activation offload fits budget={budget:,.0f} bytes: offloading every module "
                         f"({allowed}) still leaves {least:,.0f} bytes for {in_flight} micro-batch(es) in flight of "
                         f"{layers} layer(s). Raise the budget, recompute whole layers (SelectiveRecompute('full')), or "
                         f"split the activations further (a larger tp or cp, or a smaller micro-batch).")
    return best


def _applying(names: Sequence[str], experts: Optional[MixtureShape]) -> list[str]:
    """The recomputed or offloaded modules that apply to a dense layer (``experts`` ``None``) or a mixture's: a dense
    MLP's to the one, the experts' to the other (:func:`~lightning_seqpar.recompute.apply_recompute_modules`)."""
    other = ("moe", "moe_act", "shared_experts", *EXPERT_MODULES) if experts is None else ("mlp",)
    return [m for m in names if m not in other]
