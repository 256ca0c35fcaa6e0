"""Spawn launcher that returns the *whole* trained model to the main process."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_seqpar.lightning._compat import MultiProcessingLauncher, WorkerOutput


class SeqParallelSpawnLauncher(MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, with two changes.

    * Rank 0 sends back the gathered single-device state dict (the workers' modules hold shards),
      so the model in the main process ends up trained, as with DDP.
    * Workers leave through a barrier, ``destroy_process_group()`` and an immediate exit: gloo workers
      otherwise abort now and then in interpreter teardown.
    """

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[WorkerOutput]:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        state_dict = trainer.strategy.full_state_dict()  # collective: every rank takes part
        if trainer.strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            import tempfile

            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            trainer.strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, *args, **kwargs)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        os._exit(0)
