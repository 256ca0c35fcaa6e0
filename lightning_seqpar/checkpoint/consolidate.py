"""A sharded checkpoint as the single-device state dict, without any process group.

``consolidate`` reads every ``state_dict.*`` tensor of a sharded checkpoint directory whole (DCP assembles
each from the shards of whatever layout wrote it), restores each single-device shape recorded in the
checkpoint (fused q/k/v is stored ``[3, n, ...]``) and returns what the original, unparallelized
module's ``load_state_dict`` accepts. The whole model is in host memory once. :func:`consolidate_to_safetensors`
streams instead: one tensor in memory at a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_seqpar.checkpoint.atomic import folder_lock, publish, recover_stale, temporary_path
from lightning_seqpar.checkpoint.safe_reader import read_metadata
from lightning_seqpar.checkpoint.manifest import check_zip_file, is_zip_file
from lightning_seqpar.checkpoint.locate import not_a_checkpoint
from lightning_seqpar.checkpoint.sharded import FORMAT_KEY, MODEL_PREFIX, is_sharded_checkpoint, read_shards
from lightning_seqpar.checkpoint.trainer_checkpoint import read_trainer_state, verified
from lightning_seqpar.hf.streaming import SafetensorsStreamWriter, TensorEntry
from lightning_seqpar.hf.weights import load_safetensors_file, save_safetensors_file


def _under(prefix: str, keys: list[str], path: Path) -> list[str]:
    """The keys under ``prefix`` (all when it is empty).

    Raises:
        ValueError: none is, naming the prefix and keys that exist.
    """
    chosen = [k for k in keys if k.startswith(prefix)]
    if not chosen:
        raise ValueError(f"No key of {path} starts with prefix '{prefix}' (it holds e.g. {keys[:4]}).")
    return chosen


class StoredModel:
    """The model tensors of a sharded checkpoint, read one at a time (DCP assembles each from the shards of whatever
    layout wrote it): the checkpoint is checked against its manifest first.

    Attributes:
        trainer_state: ``trainer_state.pt`` (hyperparameters, loops, ...).
        shapes: single-device shape of every state-dict key, in the model's order.
        tied: ``{alias: key}`` of tied parameters (stored once, under ``key``).

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: a file that is not what was written; from :func:`~.trainer_checkpoint.read_trainer_state`.
    """

    def __init__(self, path: os.PathLike | str, allow_unverified: bool = False) -> None:
        self.path = Path(path)
        if not is_sharded_checkpoint(self.path):
            raise FileNotFoundError(not_a_checkpoint(self.path) if self.path.is_dir() else
                                    f"{self.path} is not a complete sharded checkpoint directory (no .metadata inside).")
        # Held until close(): a job saving into the folder waits, so every tensor read is of the save verified.
        self._lock = folder_lock(self.path.parent, exclusive=False)
        self._lock.__enter__()
        try:
            self._open(allow_unverified)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "StoredModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the folder's read lock."""
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def _open(self, allow_unverified: bool) -> None:
        verified(self.path, allow_unverified)
        self.trainer_state = read_trainer_state(self.path)
        info = self.trainer_state[FORMAT_KEY]
        self.shapes, self.tied = info["single_device_shapes"], info["tied"]
        self._saved = {k[len(MODEL_PREFIX):]: v for k, v in read_metadata(self.path).state_dict_metadata.items()
                       if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}

    def stored_key(self, key: str) -> Optional[str]:
        """Where ``key``'s values are stored (its tied twin's key for an alias); ``None`` if it holds no tensor."""
        stored = self.tied.get(key, key)
        return stored if stored in self._saved else None

    def dtype(self, key: str) -> torch.dtype:
        return self._saved[self.tied.get(key, key)].properties.dtype

    def read(self, key: str) -> Tensor:
        """The single-device tensor of ``key``, read whole from the shards."""
        return self.read_many([key])[key]

    def read_many(self, keys: list[str]) -> dict[str, Tensor]:
        """The single-device tensors of ``keys``, in one read; tied keys share one tensor."""
        stored = {self.tied.get(key, key) for key in keys}
        targets = {MODEL_PREFIX + k: torch.empty(tuple(self._saved[k].size), dtype=self._saved[k].properties.dtype)
                   for k in stored}
        read_shards(targets, self.path, no_dist=True)
        return {key: targets[MODEL_PREFIX + self.tied.get(key, key)].view(self.shapes[key]) for key in keys}


def consolidate(path: os.PathLike | str, prefix: str = "", allow_unverified: bool = False) -> dict[str, Tensor]:
    """The single-device model state dict held by the sharded checkpoint directory ``path``, keyed as the
    LightningModule's ``state_dict`` (tied parameters: one tensor under each of their keys); with ``prefix`` (e.g.
    ``"model."``), only the keys under it, without it: the state dict of the submodule your module holds under that
    name. Only those tensors are read.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: a file that is not what was written (:func:`~.trainer_checkpoint.verified`), from
            :func:`~.trainer_checkpoint.read_trainer_state`; no key under ``prefix``. ``allow_unverified``: read
            a checkpoint whose manifest is gone.
    """
    with StoredModel(path, allow_unverified) as stored:
        keys = [key for key in _under(prefix, list(stored.shapes), stored.path) if stored.stored_key(key) is not None]
        values = stored.read_many(keys)
    return {key[len(prefix):]: values[key] for key in keys}


def consolidate_to_safetensors(path: os.PathLike | str, out: os.PathLike | str, prefix: str = "",
                               allow_unverified: bool = False) -> tuple[int, int]:
    """Write the single-device state dict of the sharded checkpoint ``path`` (as :func:`consolidate` returns it with
    ``prefix``, tied keys included) to the safetensors file ``out``, one tensor at a time: each is read whole from the shards
    (DCP), written and dropped, so memory holds the largest tensor at most. Published atomically. Returns
    ``(tensors, bytes)`` written.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: from :func:`~.trainer_checkpoint.read_trainer_state`.
        ImportError: never (the file is written without the safetensors package).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_stale(out.parent)  # what writers killed earlier left there
    tmp = temporary_path(out)
    try:
        with StoredModel(path, allow_unverified) as stored:  # released before publishing (perhaps into its folder)
            keys = [k for k in _under(prefix, list(stored.shapes), stored.path) if stored.stored_key(k) is not None]
            entries = [TensorEntry(key[len(prefix):], stored.dtype(key), tuple(stored.shapes[key])) for key in keys]
            with SafetensorsStreamWriter(tmp, entries) as writer:
                for entry in entries:
                    writer.write(entry.name, stored.read(prefix + entry.name))
        publish(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return len(entries), sum(e.nbytes for e in entries)


def write_state_dict(state_dict: dict[str, Tensor], out: os.PathLike | str) -> Path:
    """Write ``state_dict`` to ``out`` atomically: safetensors if it ends in ``.safetensors`` (needs the
    ``safetensors`` package), ``torch.save`` otherwise. Returns ``out``.

    Raises:
        ImportError: ``.safetensors`` asked without the package, with the install command.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_stale(out.parent)
    tmp = temporary_path(out)
    try:
        if out.suffix == ".safetensors":
            save_safetensors_file(state_dict, tmp)
        else:
            torch.save(state_dict, tmp)
        publish(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def load_state_dict_file(path: os.PathLike | str, names: Optional[list[str]] = None) -> dict[str, Tensor]:
    """A single-device state dict from a ``.pt``/``.ckpt`` file (read with ``weights_only=True`` and memory
    mapping, so only the bytes used are read), a ``.safetensors`` file, or a sharded checkpoint directory.
    A Lightning checkpoint file gives its ``state_dict``. ``names``: only these keys."""
    path = Path(path)
    if path.is_dir():
        state = consolidate(path)
    elif path.suffix == ".safetensors":
        state = load_safetensors_file(path)
    else:
        if is_zip_file(path):
            check_zip_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    return state if names is None else {k: v for k, v in state.items() if k in names}
