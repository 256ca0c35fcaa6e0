"""Checkpoint files written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

_TMP_MARK = ".tmp-"


def _temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")


def _writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return pid != os.getpid()


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the hidden temporary files (``.NAME.tmp-PID``) that writers killed mid-save left in
    ``directory``; keep those of writers still running. Returns what was removed."""
    removed = []
    for tmp in directory.glob(f".*{_TMP_MARK}*"):
        pid = tmp.name.rpartition(_TMP_MARK)[2]
        if pid.isdigit() and not _writer_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX); Windows cannot open directories.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes to a temporary file in the target folder, flushes it to disk,
    renames it over the target and flushes the folder, so a crash mid-save leaves the previous checkpoint
    intact. Temporary files of writers killed earlier are removed on the next save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically.

        Raises:
            TypeError: if ``storage_options`` is given (there are none).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        tmp = _temporary_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_directory(path.parent)
        finally:
            if tmp.exists():
                tmp.unlink()
