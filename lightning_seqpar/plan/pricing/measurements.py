"""What pricing reads of the model beyond its inventory: fits of what small copies of it measured, handed in as data.

Pricing runs no model. Where a model can be probed (a Hugging Face config), the planner hands it a
:class:`Measurements`; each method returns a fit, fitted once per model and layout by whoever implements it (the
probes: :class:`~lightning_seqpar.plan.measuring.fits.ProbedMeasurements`), whose methods scale what was measured to
the layout's sizes. Without one (``None``), pricing uses Table 2's model (:mod:`.activations`) and prices no
element-wise work.
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning_seqpar.plan.pricing.model_inventory import ModelInventory


class Measurements(Protocol):
    """Fits of a model's measured bytes and work, by layout.

    Each returns the fit of ``inventory``'s model at tensor-parallel size ``tp`` under Lightning's ``precision``:
    the activation fits' ``bytes``/``first_layer_saving``/``mlp_bytes`` (per micro-batch, bytes) and ``bytes``/
    ``prologue_bytes`` (outside the layers), and the work fits' ``layer``/``rest`` (element-wise operators and bytes
    they move), each of ``(s, b, head_dim, ffn or vocabulary)``.
    """

    def layer(self, inventory: ModelInventory, tp: int, recompute: str, precision: str, modules: tuple[str, ...],
              offload: tuple[str, ...], split: bool) -> Any:
        """What one layer keeps for backward per micro-batch (``split``: its backward split into B and W)."""

    def outside(self, inventory: ModelInventory, tp: int, precision: str, recompute: str) -> Any:
        """What a forward keeps outside the layers (embedding, prologue, final norm, head, loss)."""

    def work(self, inventory: ModelInventory, tp: int, recompute: str, precision: str, modules: tuple[str, ...],
             offload: tuple[str, ...], split: bool) -> Any:
        """The element-wise work of a layer and of the rest of a step."""

    def context_work(self, cp: int, comm: str, heads: int, kv_heads: int, head_dim: int, precision: str,
                     fused: bool) -> Any:
        """The element-wise work a context-parallel layer's blockwise attention adds (``heads``, ``kv_heads``: a
        rank's)."""
