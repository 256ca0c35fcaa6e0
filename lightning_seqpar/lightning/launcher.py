"""How the strategy starts its processes: Lightning's popen launcher, or a spawn/fork launcher that returns the
*whole* trained model to the main process."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.trainer.states import TrainerFn

from lightning_seqpar.lightning._compat import MultiProcessingLauncher, SubprocessScriptLauncher, WorkerOutput


class _ChecksFirst:
    """A launcher that runs ``check(strategy, module, trainer, rank_zero)`` in the launching process before it starts
    any rank (set by :func:`configure_launcher`; ``rank_zero``: the launching process goes on as rank 0): a layout
    error is raised once, before the ranks exist."""

    check: Optional[Callable[[Any, Any, Any, bool], None]] = None
    checked_strategy: Any = None
    launching_process_is_rank_0 = False
    """popen: the launching process goes on as rank 0, so a layout it chooses (``layout=AutoLayout``) is its own;
    spawn: the ranks are new processes, which choose it themselves."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.check is not None and args:  # the module given to fit/validate/test/predict
            self.check(self.checked_strategy, args[0], trainer, self.launching_process_is_rank_0)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class SeqParallelSpawnLauncher(_ChecksFirst, MultiProcessingLauncher):
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


LAUNCHER_PID = "LIGHTNING_SEQPAR_LAUNCHER_PID"


class SeqParallelPopenLauncher(_ChecksFirst, SubprocessScriptLauncher):
    """Lightning's popen launcher (re-runs the script per rank, as DDP does), whose children end with it: each is
    told the launcher's PID and asks the kernel to kill it when its parent dies (:func:`end_with_launcher`), so a
    launcher that is killed leaves no rank running (they would otherwise wait in a collective until the timeout).
    A launcher that exits normally first waits for its ranks (up to 2 minutes), so none is cut short."""

    launching_process_is_rank_0 = True

    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER_PID] = str(os.getpid())
        try:
            super()._call_children_scripts()
        finally:
            del os.environ[LAUNCHER_PID]
        # A launcher that ends normally lets its ranks finish what follows their last collective (a failing one has
        # Lightning kill them first; a killed one takes them with it).
        atexit.register(self._wait_for_ranks)

    def _wait_for_ranks(self, timeout: float = 120.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return


def end_with_launcher() -> None:
    """In a rank started by :class:`SeqParallelPopenLauncher`: be killed when the launcher dies (Linux's
    ``PR_SET_PDEATHSIG``), or exit now if it already has. Elsewhere, nothing."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # the launcher died before the request took effect
        os._exit(1)


def stop_started_ranks(launcher: Any, local_rank: int) -> None:
    """After a failed collective in the popen launcher's process (rank 0): kill the ranks it started, which would
    otherwise wait for it until their own timeout, or stay stopped."""
    if isinstance(launcher, SubprocessScriptLauncher) and local_rank == 0:
        launcher.kill(signal.SIGKILL)


def configure_launcher(strategy: Any, environment: ClusterEnvironment, start_method: str,
                       check: Optional[Callable[[Any, Any, Any, bool], None]] = None) -> Optional[Any]:
    """The launcher of ``strategy``: none when the cluster starts the processes (torchrun, SLURM, or this is a rank
    the popen launcher started: it then ends with its launcher), :class:`SeqParallelPopenLauncher` or
    :class:`SeqParallelSpawnLauncher`, which run ``check(strategy, module, trainer, rank_zero)`` before starting any
    rank (``rank_zero``: the launching process goes on as rank 0)."""
    if environment.creates_processes_externally:
        end_with_launcher()
        return None
    if start_method == "popen":
        launcher: Any = SeqParallelPopenLauncher(environment, strategy.num_processes, strategy.num_nodes)
    else:
        launcher = SeqParallelSpawnLauncher(strategy, start_method=start_method)
    launcher.check, launcher.checked_strategy = check, strategy
    return launcher


def check_start_method(start_method: str) -> None:
    """Raise ``ValueError`` unless ``start_method`` is one the launcher knows."""
    if start_method not in ("popen", "spawn", "fork"):
        raise ValueError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}.")
