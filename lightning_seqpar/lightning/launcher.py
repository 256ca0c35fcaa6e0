"""How the strategy starts its processes: Lightning's popen launcher, or a spawn/fork launcher that returns the
*whole* trained model to the main process."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.trainer.states import TrainerFn

from lightning_seqpar.lightning._compat import MultiProcessingLauncher, SubprocessScriptLauncher, WorkerOutput


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


def configure_launcher(strategy: Any, environment: ClusterEnvironment, start_method: str) -> Optional[Any]:
    """The launcher of ``strategy``: none when the cluster starts the processes (torchrun, SLURM), Lightning's
    popen launcher (re-runs the script per rank, as DDP does) or :class:`SeqParallelSpawnLauncher`."""
    if environment.creates_processes_externally:
        return None
    if start_method == "popen":
        return SubprocessScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
    return SeqParallelSpawnLauncher(strategy, start_method=start_method)
