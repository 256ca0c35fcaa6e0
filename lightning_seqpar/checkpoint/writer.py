"""Writing a sharded checkpoint directory atomically, in the foreground or while training goes on.

Every rank writes its shards into ``.NAME.tmp-PID`` (PID: the coordinator's, so every rank agrees) beside
the target; when DCP has written its index, which it does only after every rank reported its files, every rank
records the size and CRC-32 of its files and the coordinator writes the manifest (:mod:`.manifest`) and
publishes the directory under ``NAME`` (see :mod:`.atomic`).
A save killed at any moment therefore leaves the previous checkpoint under ``NAME`` and no partial one.

With ``async_save``, ``torch.distributed.checkpoint.async_save`` copies the state to host memory (staging,
on the caller's thread; the copy costs one more shard of host memory until written) and writes in a
background thread; the coordinator publishes when it completes. One save is in flight at a time: the
next save, and :meth:`ShardedCheckpointWriter.wait`, wait for it. The background collectives need a
process group of their own (gloo), so they never interleave with training's.
"""

from __future__ import annotations

import shutil
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_seqpar.checkpoint.atomic import other_live_writers, publish, recover_stale, temporary_path, writer_identity
from lightning_seqpar.checkpoint.manifest import file_entry, write_manifest
from lightning_seqpar.checkpoint.safe_reader import METADATA_FILE
from lightning_seqpar.checkpoint.sharded import FORMAT_KEY, TRAINER_STATE_FILE


class ShardedCheckpointWriter:
    """Saves sharded checkpoints of one job (every rank holds one writer).

    Args:
        coordinator: whether this rank publishes (rank 0).
        coordinator_pid: the coordinator's identity (:func:`coordinator_pid`), which names the temporary directory
            on every rank.
        process_group: the group DCP's collectives run on (default: the world); required, and of its own,
            for ``async_save``.
        async_save: write in the background while training continues.
    """

    def __init__(self, coordinator: bool, coordinator_pid: int | str, process_group: Optional[Any] = None,
                 async_save: bool = False) -> None:
        self.coordinator, self.coordinator_pid = coordinator, coordinator_pid
        self.process_group, self.async_save = process_group, async_save
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._save_id = ""

    def save(self, path: Path, entries: Mapping[str, Tensor], trainer_state: Mapping[str, Any]) -> None:
        """Write ``entries`` (DCP views, every rank its own) and the coordinator's ``trainer_state`` to ``path``.

        Collective over ``process_group``; returns when published, or, with ``async_save``, once staged.

        Raises:
            Whatever the previous asynchronous save raised, re-raised here (or by :meth:`wait`).
        """
        self.wait()
        path = Path(path)
        tmp = temporary_path(path, self.coordinator_pid)
        if self.coordinator:
            path.parent.mkdir(parents=True, exist_ok=True)
            recover_stale(path.parent)
            others = other_live_writers(path.parent, str(self.coordinator_pid))
            if others:  # publishing is serialized (folder lock), but the jobs replace each other's checkpoints
                warnings.warn(f"Another job (writer {', '.join(others)}) is saving checkpoints into {path.parent} too: "
                              f"each replaces the other's {path.name}. Give each run its own checkpoint folder.")
            tmp.mkdir()
            trainer_state = dict(trainer_state)
            self._save_id = uuid.uuid4().hex
            trainer_state[FORMAT_KEY] = {**trainer_state.get(FORMAT_KEY, {}), "save_id": self._save_id}
            with open(tmp / TRAINER_STATE_FILE, "wb") as f:
                torch.save(trainer_state, f)
        dist.barrier(group=self.process_group)  # the directory exists before anyone writes into it
        writer = FileSystemWriter(tmp)
        if not self.async_save:
            try:
                dcp.save(dict(entries), storage_writer=writer, process_group=self.process_group)
                self._write_manifest(tmp)
            except CheckpointException as error:  # a BaseException: name the checkpoint (a full disk, ...)
                self._discard(tmp)
                raise OSError(f"Writing the checkpoint {path} failed: {str(error)[:500]}") from error
            except BaseException:
                self._discard(tmp)
                raise
            if self.coordinator:
                publish(tmp, path)
            return
        written = dcp.async_save(dict(entries), storage_writer=writer, process_group=self.process_group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-publish")
        self._pending = self._executor.submit(self._finish, written, tmp, path)

    def _finish(self, written: Any, tmp: Path, path: Path) -> None:
        try:
            written.result()
            self._write_manifest(tmp)
        except CheckpointException as error:  # a full disk, ...: named with the checkpoint, as a synchronous save
            self._discard(tmp)
            raise OSError(f"Writing the checkpoint {path} in the background failed: {str(error)[:500]}") from error
        except BaseException:
            self._discard(tmp)
            raise
        if self.coordinator:
            publish(tmp, path)

    def _write_manifest(self, tmp: Path) -> None:
        """Every rank records the files it wrote (DCP names them ``__RANK_*``); the coordinator adds ``.metadata``
        and ``trainer_state.pt`` and writes the manifest last (collective over ``process_group``)."""
        distributed = dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        rank = dist.get_rank(self.process_group) if distributed else 0
        mine = {p.name: file_entry(p) for p in sorted(tmp.glob(f"__{rank}_*"))}
        gathered: list[Any] = [mine]
        if distributed:
            gathered = [None] * dist.get_world_size(self.process_group) if self.coordinator else None
            dst = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            dist.gather_object(mine, gathered, dst=dst, group=self.process_group)
        if self.coordinator:
            files = {name: entry for part in gathered for name, entry in part.items()}
            files.update({name: file_entry(tmp / name) for name in (METADATA_FILE, TRAINER_STATE_FILE)})
            write_manifest(tmp, self._save_id, files)

    def _discard(self, tmp: Path) -> None:
        if self.coordinator and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published.

        Raises:
            Whatever that save raised.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`wait`, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def coordinator_pid(process_group: Optional[Any] = None) -> str:
    """Rank 0's writer identity (``PID-START``, :func:`~.atomic.writer_identity`), on every rank (collective)."""
    value = [writer_identity()]
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        dist.broadcast_object_list(value, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)
    return value[0]
