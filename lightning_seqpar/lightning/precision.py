"""Lightning precision plugins that clip by the norm of the whole, unsharded gradient.

Lightning clips through its precision plugin (``Precision.clip_grad_by_norm``), which calls
``torch.nn.utils.clip_grad_norm_`` on this rank's parameters: under tensor parallelism that is the
norm of one shard, and under pipeline parallelism of one stage. :class:`ShardAwareClipping` replaces
that one method with :func:`lightning_seqpar.optim.clip_grad_norm_` (every shard once, every
replicated parameter once, summed over stages). Lightning picks the plugin from ``Trainer(precision=...)``
before the strategy sees it, so :func:`shard_aware` gives the strategy the same plugin as its
shard-aware subclass, built with the same arguments.
"""

from __future__ import annotations

from typing import Optional, Union

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer

from lightning_seqpar.optim.gradients import clip_grad_norm_
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.recompute import rewritten_layers
from lightning_seqpar.transformer.residual import cast_residual_stream


class ShardAwareClipping:
    """Mixin for a Lightning ``Precision`` plugin: gradient-norm clipping over the whole model.

    Attributes:
        mesh: the process mesh the norm is reduced over; set by the strategy once processes exist.
    """

    mesh: Optional[ParallelMesh] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Scale the gradients so that the unparallelized model's gradient norm is at most ``clip_val``.

        Raises:
            RuntimeError: before the strategy has set :attr:`mesh`.
        """
        if self.mesh is None:
            raise RuntimeError("Gradient clipping ran before SeqParallelStrategy set up its process mesh.")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's
        own = getattr(optimizer, "clip_grad_norm_", None)  # zero=1: the gradients are its owned element ranges
        if callable(own):
            own(clip_val)
            return
        clip_grad_norm_(self.main_params(optimizer), clip_val, self.mesh)  # type: ignore[attr-defined]


class SeqParallelPrecision(ShardAwareClipping, Precision):
    """``precision="32-true"``."""


class SeqParallelDoublePrecision(ShardAwareClipping, DoublePrecision):
    """``precision="64-true"``."""


class SeqParallelHalfPrecision(ShardAwareClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"``."""


class SeqParallelMixedPrecision(ShardAwareClipping, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` (the gradient scaler unscales before clipping, as in Lightning)."""


def shard_aware(plugin: Optional[Precision]) -> Precision:
    """The shard-aware version of one of Lightning's precision plugins (``None``: 32-true).

    Raises:
        ValueError: for a plugin class other than Lightning's ``Precision``, ``DoublePrecision``,
            ``HalfPrecision`` and ``MixedPrecision`` that does not already mix in :class:`ShardAwareClipping`.
    """
    if plugin is None:
        return SeqParallelPrecision()
    if isinstance(plugin, ShardAwareClipping):
        return plugin
    kind = type(plugin)
    if kind is Precision:
        return SeqParallelPrecision()
    if kind is DoublePrecision:
        return SeqParallelDoublePrecision()
    if kind is HalfPrecision:
        return SeqParallelHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    if kind is MixedPrecision:
        return SeqParallelMixedPrecision(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]
    raise ValueError(
        f"SeqParallelStrategy cannot clip gradients correctly with the precision plugin {kind.__name__}: its "
        f"clip_grad_by_norm would see one shard. Use Trainer(precision='32-true' | '64-true' | 'bf16-true' | "
        f"'bf16-mixed' | '16-true' | '16-mixed'), or add lightning_seqpar.lightning.precision.ShardAwareClipping as the "
        f"first base class of {kind.__name__}."
    )


def low_precision_residual(model: nn.Module, plugin: Precision) -> None:
    """Keep the residual stream of ``model``'s rewritten layers in autocast's 16-bit dtype
    (:func:`lightning_seqpar.transformer.residual.cast_residual_stream`): pipeline transfers and the norm inputs
    kept for backward then take 2 bytes per element, Table 2's count, at the cost of 16-bit residual additions.

    Raises:
        ValueError: when ``plugin`` is not autocast's (``bf16-mixed`` / ``16-mixed``): under ``bf16-true`` the
            stream is 16-bit already, under ``32-true`` / ``64-true`` there is no 16-bit dtype to cast to.
    """
    if not isinstance(plugin, MixedPrecision):
        raise ValueError(
            f"PrecisionConfig(low_precision_residual=True) casts the residual stream to autocast's 16-bit dtype "
            f"and needs Trainer(precision='bf16-mixed') or '16-mixed'; got precision={plugin.precision!r}. "
            f"Under 'bf16-true' the residual stream is 16-bit already: drop the option."
        )
    cast_residual_stream(rewritten_layers(model))
