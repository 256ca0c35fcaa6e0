"""The probes as pricing's :class:`~lightning_seqpar.plan.pricing.measurements.Measurements`: each fit measured
once per model and layout, kept in the caller's ``fits`` (a dict, or the on-disk
:class:`~lightning_seqpar.plan.measuring.fit_cache.FitCache`), under keys that name everything it depends on."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from lightning_seqpar.plan.measuring.probe import LayerFit, OutsideFit, fit_layer, fit_outside
from lightning_seqpar.plan.measuring.work import ContextWork, WorkFit, fit_context_work, fit_work
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory


class ProbedMeasurements:
    """Fits from probes of small copies of the model (:mod:`.probe`, :mod:`.work`), cached in ``fits``.

    Args:
        fits: the cache, shared between questions (a fit is keyed by the model's ``probe_key``, so models never
            share one); the probes also read the measurements kept in it.
    """

    def __init__(self, fits: MutableMapping[tuple, Any]) -> None:
        self.fits = fits

    def layer(self, inventory: ModelInventory, tp: int, recompute: str, precision: str, modules: tuple[str, ...],
              offload: tuple[str, ...], split: bool) -> LayerFit:
        key = (inventory.probe_key, tp, recompute, precision) + ((modules, offload) if modules or offload else ()) \
            + (("split",) if split else ())
        if key not in self.fits:
            self.fits[key] = fit_layer(inventory.config, tp, True, recompute, precision, inventory.experts,
                                       modules=modules, offload=offload, training=inventory.training, split=split,
                                       measured=self.fits)
        return self.fits[key]

    def outside(self, inventory: ModelInventory, tp: int, precision: str, recompute: str) -> OutsideFit:
        key = (inventory.probe_key, "outside", tp, precision, recompute)
        if key not in self.fits:
            self.fits[key] = fit_outside(inventory.config, tp, True, precision, inventory.training, recompute,
                                         inventory.experts, measured=self.fits)
        return self.fits[key]

    def work(self, inventory: ModelInventory, tp: int, recompute: str, precision: str, modules: tuple[str, ...],
             offload: tuple[str, ...], split: bool) -> WorkFit:
        key = (inventory.probe_key, "work", tp, recompute, precision, modules, offload, split)
        if key not in self.fits:
            self.fits[key] = fit_work(inventory.config, tp, True, recompute, precision, inventory.experts,
                                      modules=modules, offload=offload, training=inventory.training, split=split)
        return self.fits[key]

    def context_work(self, cp: int, comm: str, heads: int, kv_heads: int, head_dim: int, precision: str,
                     fused: bool) -> ContextWork:
        key = ("context work", cp, comm, heads, kv_heads, head_dim, precision, fused)
        if key not in self.fits:
            self.fits[key] = fit_context_work(cp, comm, heads, kv_heads, head_dim, precision, fused)
        return self.fits[key]
