"""The default process group's life under the strategy: started from Lightning's cluster environment with a
bounded timeout, the strategy's collectives on it, torn down cleanly at exit, and a failed collective named when a
peer stalls or dies."""

from __future__ import annotations

import atexit
import logging
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from lightning_seqpar._compat import set_process_group_timeout
from lightning_seqpar.lightning.failure import FailureWatch, report_failure
from lightning_seqpar.lightning._compat import init_dist_connection
from lightning_seqpar.parallel.faults import failed_collective

log = logging.getLogger(__name__)


def as_timedelta(timeout: Union[float, timedelta, None]) -> timedelta:
    """Seconds or a ``timedelta`` (``None``: torch's default, 30 minutes) as a positive ``timedelta``.

    Raises:
        ValueError: a value that is not positive, or not a number or ``timedelta``.
    """
    if timeout is None:
        return default_pg_timeout
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a datetime.timedelta, got {given!r}.")
    return timeout


def _destroy_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:  # every rank is done with its peers before any tears its connections down (bounded: a peer may be gone)
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - at exit, a missing peer is no reason to keep the process
        pass
    dist.destroy_process_group()


# Processes start at their own pace (imports, a cold file cache, a busy node): waiting for all of them to join is
# not a collective stalled on a peer, and gets at least this long.
START_TIMEOUT = timedelta(minutes=5)


def set_world_ranks(environment: Optional[ClusterEnvironment], global_rank: int, world_size: int) -> None:
    """Tell the cluster environment (and Lightning's rank-zero utilities) this process's rank and the world size, as
    Lightning's DDP strategy does before the process group starts."""
    if environment is not None:
        environment.set_global_rank(global_rank)
        environment.set_world_size(world_size)
    rank_zero_only.rank = global_rank


def start_process_group(environment: ClusterEnvironment, backend: str, timeout: timedelta) -> FailureWatch:
    """Initialize the default process group from ``environment`` (as Lightning's DDP strategy does), waiting up to
    ``max(timeout, 5 minutes)`` for every process to join, then ``timeout`` in each collective; destroy it at
    interpreter exit after a bounded barrier. Returns this rank's watch over the other ranks' failures."""
    init_dist_connection(environment, backend, timeout=max(timeout, START_TIMEOUT))
    if timeout < START_TIMEOUT:
        set_process_group_timeout(timeout)
    # Lightning does this for NCCL only. gloo's worker threads, left to interpreter teardown, abort a
    # finished process now and then ("terminate called without an active exception", rc 134).
    atexit.unregister(_destroy_process_group)  # once, however many trainers this process runs
    atexit.register(_destroy_process_group)
    return FailureWatch(dist.get_rank(), dist.get_world_size())  # another rank's error ends this one too (report_failed_collective)


def report_failed_collective(exception: BaseException, rank: int, timeout: timedelta,
                             watch: Optional[FailureWatch] = None) -> bool:
    """Tell the other ranks this one failed (``watch``: they stop within seconds instead of waiting for it), and log
    which collective ``exception`` was raised in and what it means (a stalled or a lost peer, and the fix); ``False``
    when it was not raised in a collective."""
    report_failure(watch, exception)
    failure = failed_collective(exception)
    if failure is None:
        return False
    if failure.timed_out:
        log.error(
            f"[rank {rank}] {failure.collective} timed out after {timeout.total_seconds():g} s "
            f"waiting for another rank: a peer is stalled (stopped, swapping, stuck in I/O) or far slower. The job "
            f"stops. If the peers are only slow, raise LaunchConfig(timeout=...) (recipe: "
            f"strategy.launch.timeout=SECONDS)."
        )
    else:
        log.error(f"[rank {rank}] {failure.collective} failed: another rank is gone ({exception}).")
    return True


def barrier(device: Any) -> None:
    """The strategy's ``barrier`` on the default process group (``device``: this rank's, for NCCL); a no-op before
    the group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """The strategy's ``broadcast`` of a picklable object from rank ``src``; ``obj`` itself before the group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
    """The strategy's ``reduce`` (for ``self.log(..., sync_dist=True)``): ``tensor`` all-reduced in place over
    ``group`` (``None``: every rank) and returned; ``reduce_op`` ``"mean"``/``"avg"`` (a sum divided by the group's
    size, integer tensors rounded toward zero as Lightning does), ``"sum"``/``"max"``/``"min"`` or a ``dist.ReduceOp``. A
    value that is not a tensor, or a run without a process group, is returned as it is.

    Lightning's own ``_sync_ddp`` calls ``dist.barrier`` before the all-reduce. The all-reduce orders the ranks by
    itself, and on NCCL a barrier blocks the host until the device has run it: one host sync per logged value per
    step, measured on an H100 (``docs/gpus.md``). So this is the reduction without the barrier."""
    if not isinstance(tensor, Tensor) or not (dist.is_available() and dist.is_initialized()):
        return tensor
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if mean or reduce_op is None:
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        op = getattr(dist.ReduceOp, reduce_op.upper(), None)
        if op is None:
            raise ValueError(f"reduce_op={reduce_op!r}: use 'mean', 'sum', 'max', 'min' or a torch.distributed.ReduceOp.")
    else:
        op = reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor.div(size, rounding_mode="trunc"))
