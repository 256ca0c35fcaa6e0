"""Checkpoint files written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes to a temporary file in the target folder, flushes it to disk
    and renames it over the target, so a crash mid-save leaves the previous checkpoint intact."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, os.PathLike], storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
