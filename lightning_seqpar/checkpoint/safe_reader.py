"""Reading a DCP checkpoint directory without unpickling arbitrary objects.

DCP stores its index (``.metadata``) with :mod:`pickle`, and a pickle can run any code. The reader here
unpickles it with an allowlist of the metadata classes DCP writes (and the torch dtypes and sizes
they hold); anything else is refused. Tensor data is read by DCP itself with ``weights_only=True``.
Nothing is stored as pickled bytes in our checkpoints (bytes entries would be ``torch.load``-ed with
``weights_only=False`` by DCP): non-tensor state goes to a separate file loaded with ``weights_only=True``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == _DCP_METADATA
            or (module, name) in _ALLOWED
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"The checkpoint index refers to {module}.{name}, which a torch.distributed.checkpoint index never "
                f"holds: the file was tampered with or is not a checkpoint index. Refusing to load it."
            )
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """The DCP index of checkpoint directory ``path``, unpickled with the allowlist.

    Raises:
        FileNotFoundError: ``path`` has no ``.metadata`` (not a complete DCP checkpoint).
        pickle.UnpicklingError: the index names a class outside the allowlist.
    """
    with open(Path(path) / METADATA_FILE, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path / METADATA_FILE} does not hold a checkpoint index.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose index is read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank indexes are not written by our checkpoints
            raise FileNotFoundError("Per-rank checkpoint indexes are not supported.")
        metadata = read_metadata(Path(self.path))
        # DCP's own reader fills these in (see FileSystemReader.read_metadata); keep its behaviour.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
