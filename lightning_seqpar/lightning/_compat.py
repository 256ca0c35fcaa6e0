"""Every private Lightning name the library uses, in one place.

Each entry says why it is needed and which public alternative was checked (Lightning 2.6, the version
``setup.cfg`` pins and CI tests). ``tests/package/test_layering.py`` fails if a private library name is used
anywhere but here and in :mod:`lightning_seqpar._compat` (torch's), so an upgrade has one file to review.
"""

from __future__ import annotations

from typing import Any

# Starts the default process group from a Lightning ClusterEnvironment (MASTER_ADDR/PORT, rank,
# world size) and registers NCCL teardown at exit, exactly as Lightning's DDP and ModelParallel
# strategies do. Public alternative checked: torch.distributed.init_process_group, which would mean
# re-implementing the environment hand-off and the NCCL atexit handling.
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: F401

# Fabric's launchers give each process cpu_count // local_processes intra-op threads; the Trainer's do
# not (4 processes on 2 cores ran 4.4x slower). Public alternative: torch.set_num_threads with our own
# copy of Lightning's suggestion, which would drift from Fabric's rule.
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed  # noqa: F401

# Moves optimizer state to the device after setup, as every Lightning strategy does. No public equivalent.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: F401

# Lightning's launchers: popen re-runs the script per rank (the `ddp` default), the multiprocessing one
# spawns/forks and returns rank 0's results to the main process. Lightning exposes no public launcher
# classes; its own strategies import these. lightning_seqpar.lightning.launcher overrides two of the latter's
# private methods (_collect_rank_zero_results, _wrapping_function): the hooks Lightning's own
# subclasses override; there is no public one.
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput  # noqa: F401


def hpc_save_path(trainer: Any) -> str:
    """Where Lightning's SLURM auto-requeue saves (``hpc_ckpt_N.ckpt`` in ``default_root_dir``) and resumes from when
    the job starts again (``trainer._checkpoint_connector.hpc_save_path``)."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def record_last_checkpoint(callback: Any, path: str, step: int) -> None:
    """Tell a ``ModelCheckpoint`` that ``path`` is its ``last.ckpt`` of ``step``, saved by someone else (the preemption
    stop): it then skips its own saves at that step (``_last_global_step_saved``) and at the end of training
    (``_last_checkpoint_saved``, whose save would come once Lightning counts the epoch as finished) instead of writing
    ``last-v1.ckpt`` beside it, and keeps ``path`` as its ``last_model_path`` (what it replaces next)."""
    callback.last_model_path = path
    callback._last_global_step_saved = step
    callback._last_checkpoint_saved = path


__all__ = [
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "WorkerOutput",
    "hpc_save_path",
    "init_dist_connection",
    "optimizers_to_device",
    "record_last_checkpoint",
    "set_num_threads_if_needed",
]
