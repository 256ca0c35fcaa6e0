"""Checkpoint files written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_seqpar.checkpoint.atomic import publish, recover_stale, remove, temporary_path


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Clean up what writers killed mid-save left in ``directory`` (see
    :func:`lightning_seqpar.checkpoint.atomic.recover_stale`). Returns what was removed or restored."""
    return recover_stale(directory)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes to a temporary file in the target folder, flushes it to disk,
    renames it over the target and flushes the folder, so a crash mid-save leaves the previous checkpoint
    intact. What writers killed earlier left behind is cleaned up on the next save. Removal (``save_top_k``)
    takes a checkpoint off its name in one rename before deleting it."""

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
        recover_stale(path.parent)
        tmp = temporary_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
            publish(tmp, path)
        except OSError as error:  # a full disk names no file by itself
            raise OSError(error.errno, f"Writing the checkpoint {path} failed: {error.strerror or error}") from error
        finally:
            if tmp.exists():
                tmp.unlink()

    def remove_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        """Remove the checkpoint file or directory ``path`` atomically (see :func:`~lightning_seqpar.checkpoint.atomic.remove`)."""
        remove(Path(path))
