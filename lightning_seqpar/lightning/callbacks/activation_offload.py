"""``ActivationOffload``: the tensors named modules save for backward wait in host memory, as a Lightning callback."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from lightning_seqpar.offload import HostPool, apply_offload, check_offload_modules, check_offload_with_recompute
from lightning_seqpar.recompute import rewritten_layers


class ActivationOffload(pl.Callback):
    """Offload what the named modules of every rewritten layer save for backward to host memory (Megatron-Core's
    fine-grained activation offloading, ``--offload-modules``), and bring it back when the backward reads it.

    Args:
        modules: any combination of :data:`~lightning_seqpar.offload.OFFLOAD_MODULES`: ``"attn_norm"``,
            ``"qkv_linear"``, ``"core_attn"``, ``"attn_proj"``, ``"mlp_norm"``, ``"mlp"``.

    On CUDA the copies go to pinned memory on a side stream and come back on the compute stream after an event (no
    host synchronization); on CPU to a counted pool the memory trackers see as freed
    (:class:`~lightning_seqpar.offload.HostPool`). ``pool`` holds this rank's pool once fitting starts: its
    ``bytes_out``/``bytes_in`` are the bytes moved each way, equal to
    :func:`~lightning_seqpar.memory.activations.offloaded_activation_terms` per layer and micro-batch. Training is
    bit-identical to no offload (the same values come back). Composes with recomputation (layers checkpointed whole
    offload nothing: they keep only their input), every pipeline schedule, tensor, sequence and context parallelism.

    Raises:
        ValueError: a name not in ``OFFLOAD_MODULES`` (at construction); when fitting starts, what
            :func:`~lightning_seqpar.offload.apply_offload` and
            :func:`~lightning_seqpar.offload.check_offload_with_recompute` refuse, and compiled blocks (``compile=True``:
            the saved-tensor hooks run in Python, outside a graph).
    """

    def __init__(self, modules: list[str]) -> None:
        self.modules = check_offload_modules(modules)
        self.pool: Optional[HostPool] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compiled = [layer for layer in rewritten_layers(pl_module) if layer.compile_config is not None]
        if compiled:
            raise ValueError(f"ActivationOffload(modules={self.modules}) with compiled blocks (compile=True): the "
                             f"offload's saved-tensor hooks run in Python, outside the compiled graph. Train with "
                             f"compile=False, or recompute instead (SelectiveRecompute(modules=...)).")
        self.pool = HostPool(trainer.strategy.root_device)
        apply_offload(pl_module, self.modules, self.pool)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every callback's on_fit_start has run: a recomputation configured there is known now
        check_offload_with_recompute(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == 0:  # SelectiveRecompute("auto") plans at the first batch: check after it, whatever the order
            check_offload_with_recompute(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        apply_offload(pl_module, None, self.pool)  # type: ignore[arg-type]
