"""Preemption: SIGTERM (and SLURM's requeue signal) ends training with a checkpoint, on every rank, at one step.

Lightning 2.6 answers SIGTERM with a broadcast inside the signal handler: a collective started wherever the main
thread happened to be, unmatched on the other ranks, so the job hangs until the collective timeout and nothing is
saved; its SLURM handler saves a checkpoint (a collective) inside the handler too. Here the handler only records the
signal. At the end of each training step a rank that was signalled proposes, in the process group's store, to stop
after the next step (the first proposal wins); every rank reads the store there, so all stop after the same step,
whichever of them got the signal. Every step couples all ranks through its collectives, so no rank can have finished
that next step when the proposal is made. Then every rank saves the checkpoint together, at the end of that step's
batch, where ``ModelCheckpoint`` saves (``last.ckpt`` in the ``ModelCheckpoint`` folder; under SLURM with
auto-requeue, Lightning's ``hpc_ckpt_N.ckpt``, which it resumes from, and the job is requeued), and returns from
``fit`` normally. Saved there, the loops' progress is that of a step in the middle of an epoch: a resume continues
with the next batch of the same epoch and logs its first step as that step (saved once training had ended, Lightning
counted the epoch as finished and the logged steps ran one ahead). No collective runs in a signal handler; the time bound is one
training step plus the save.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_seqpar._compat import default_store
from lightning_seqpar.lightning._compat import hpc_save_path, record_last_checkpoint

log = logging.getLogger(__name__)

STOP_KEY = "lightning_seqpar/preempted_after_step"


def _requeue_signal(trainer: "pl.Trainer") -> Optional[signal.Signals]:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer.strategy.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


class Preemption(pl.Callback):
    """Stop on SIGTERM (and SLURM's requeue signal under auto-requeue) after a step every rank agrees on, with a
    checkpoint. :class:`~lightning_seqpar.SeqParallelStrategy` adds one when fitting unless the callbacks hold one.

    Attributes:
        preempted: the signal that stopped training (``None``: it was not stopped).
        checkpoint: where the checkpoint of the stop was written (``None``: none, e.g. no ``ModelCheckpoint``).
    """

    def __init__(self) -> None:
        self.signalled: Optional[int] = None
        self.preempted: Optional[int] = None
        self.checkpoint: Optional[Path] = None
        self._proposed, self._stop_after = False, None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.signalled, self.preempted, self.checkpoint = None, None, None
        self._proposed, self._stop_after = False, None
        # Replaces Lightning's handlers (registered just before; restored by its teardown).
        for signum in filter(None, (signal.SIGTERM, _requeue_signal(trainer))):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:  # no collective, no I/O: the main thread may be in either
        if self.signalled is None:
            self.signalled = signum

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, store = trainer.global_step, default_store()
        if 0 < trainer.max_steps <= step:
            # The run ends after this batch on every rank: nothing to agree on, and the store's host (rank 0) may
            # already be gone, so a read here could fail with "Connection reset by peer" on a slower rank.
            return
        if self.signalled is not None and not self._proposed:
            self._proposed = True
            if store is None:
                self._stop_after = step
            else:  # the first proposal wins; every rank is then at most one step from it
                store.compare_set(STOP_KEY, "", str(step + 1))
        if self._stop_after is None and store is not None and store.check([STOP_KEY]):
            self._stop_after = int(store.get(STOP_KEY))
        if self._stop_after is not None and step >= self._stop_after and self.preempted is None:
            self.preempted = self.signalled or signal.SIGTERM
            trainer.should_stop = True
            self._save(trainer)

    def _save(self, trainer: "pl.Trainer") -> None:
        """The checkpoint of the stop, at the end of the step's batch (see the module docstring)."""
        callback = trainer.checkpoint_callback
        if _requeue_signal(trainer) is not None:
            path: Optional[str] = hpc_save_path(trainer)
        else:
            dirpath = getattr(callback, "dirpath", None)
            path = str(Path(dirpath) / "last.ckpt") if dirpath else None
        if path is not None:
            trainer.save_checkpoint(path)  # collective: every rank is here, after the same step
            self.checkpoint = Path(path)
        if isinstance(callback, ModelCheckpoint):  # one save of this step: not last-v1.ckpt again at the epoch's end
            record_last_checkpoint(callback, path if path is not None and path.endswith("last.ckpt") else
                                   callback.last_model_path, trainer.global_step)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.preempted is None:
            return
        requeue = _requeue_signal(trainer) is not None
        path = None if self.checkpoint is None else str(self.checkpoint)
        store = default_store()
        if store is not None and trainer.is_global_zero:
            store.delete_key(STOP_KEY)  # after the save, which every rank joined: none reads it any more
        if trainer.is_global_zero:
            saved = f"saved {path}; resume with ckpt_path={path}" if path else "nothing saved (no ModelCheckpoint)"
            log.warning(f"Preempted (signal {int(self.preempted)}): stopped after step {trainer.global_step}, {saved}.")
            if requeue:
                _requeue_slurm_job()


def _requeue_slurm_job() -> None:
    import os

    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    log.info(f"requeued SLURM job {job}" if result.returncode == 0 else
             f"requeueing SLURM job {job} failed ({result.returncode}): {result.stderr.strip()}")


def add_preemption(trainer: "pl.Trainer") -> None:
    """Give ``trainer`` a :class:`Preemption` callback unless it has one."""
    if not any(isinstance(callback, Preemption) for callback in trainer.callbacks):
        trainer.callbacks.append(Preemption())
