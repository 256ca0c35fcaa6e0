"""``StepPeak``: the peak of live tensor bytes over one whole optimizer step of a rank, on any device (CPU included),
with the rank's model state held from the step's start: the figure the planner predicts per rank
(:func:`lightning_seqpar.plan.predict`'s ``bytes["total"]``), measured.

The bytes are :class:`~lightning_seqpar.memory.peak.PeakMemoryTracker`'s (storages the step's ops create, freed when
they are); the model state is :func:`model_state`'s tensors. Python's cyclic garbage collector is paused over the step:
a collection at a moment of its own choosing would move the peak from run to run.
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_seqpar.memory.peak import PeakMemoryTracker


def model_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Optional[torch.Tensor]]]:
    """The tensors of a rank's model state under :class:`~lightning_seqpar.SeqParallelStrategy`, by the planner's kinds:
    ``parameters``, ``gradients`` (each ``.grad``, and the gradient reduction buckets with their reduced ranges),
    ``main_params`` (the distributed optimizer's float32 copies, not the parameters themselves) and ``optimizer``
    (the optimizer's state tensors). Entries may be ``None``."""
    params = list({id(p): p for p in pl_module.parameters()}.values())
    optimizer = trainer.optimizers[0]
    inner = getattr(optimizer, "inner", optimizer)  # the distributed optimizer's wrapped optimizer
    own = {p.untyped_storage().data_ptr() for p in params}
    pieces = [p for g in inner.param_groups for p in g["params"]] if inner is not optimizer else []
    grad_sync = getattr(trainer.strategy, "grad_sync", None)
    buckets = [*getattr(getattr(grad_sync, "buckets", None), "buckets", []),
               *getattr(getattr(optimizer, "buckets", None), "buckets", [])]
    return dict(
        parameters=params,
        gradients=[*[p.grad for p in params], *[b.buffer for b in buckets],
                   *[getattr(b, "reduced", None) for b in buckets]],
        main_params=[p for p in pieces if p.untyped_storage().data_ptr() not in own],
        optimizer=[v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)],
    )


class StepPeak(pl.Callback):
    """Measures the peak of live tensor bytes over optimizer step ``step`` (0-based; the default, the second, is past
    the first step's lazily made optimizer state and buckets).

    Attributes:
        peak: bytes, after that step (``None`` before).
        pipeline_rank: the rank's pipeline stage (the planner prices each stage).
    """

    def __init__(self, step: int = 1) -> None:
        if step < 0:
            raise ValueError(f"StepPeak(step={step}): an optimizer step index, 0 or more.")
        self.step = step
        self.peak: Optional[int] = None
        self.pipeline_rank = 0
        self._tracker: Optional[PeakMemoryTracker] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx != self.step * trainer.accumulate_grad_batches:
            return
        state = model_state(trainer, pl_module)
        gc.collect()
        gc.disable()
        self._tracker = PeakMemoryTracker().__enter__()
        self._tracker.hold(*state.values())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._tracker is not None and batch_idx == (self.step + 1) * trainer.accumulate_grad_batches - 1:
            self._tracker.__exit__(None, None, None)
            gc.enable()
            self.peak, self._tracker = self._tracker.peak, None
            mesh = getattr(trainer.strategy, "mesh", None)
            self.pipeline_rank = mesh.pipeline.rank if mesh is not None else 0

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._tracker is not None:  # leave torch's dispatch and the collector as they were
            self._tracker.__exit__(None, None, None)
            gc.enable()
            self._tracker = None
