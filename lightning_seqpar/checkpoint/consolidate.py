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

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.checkpoint.safe_reader import read_metadata
from lightning_seqpar.checkpoint.manifest import check_zip_file, is_zip_file
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


def consolidate(path: os.PathLike | str, prefix: str = "") -> dict[str, Tensor]:
    """The single-device model state dict held by the sharded checkpoint directory ``path``, keyed as the
    LightningModule's ``state_dict``; with ``prefix`` (e.g. ``"model."``), only the keys under it, without it: the
    state dict of the submodule your module holds under that name.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: a file that is not what was written (:func:`~.trainer_checkpoint.verified`), from
            :func:`~.trainer_checkpoint.read_trainer_state`.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint directory (no .metadata inside).")
    verified(path)
    info = read_trainer_state(path)[FORMAT_KEY]
    shapes = info["single_device_shapes"]
    metadata = read_metadata(path)
    saved = {k: v for k, v in metadata.state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in saved.items()}
    read_shards(targets, path, no_dist=True)
    state = {k[len(MODEL_PREFIX):]: v.reshape(shapes[k[len(MODEL_PREFIX):]]) for k, v in targets.items()}
    for alias, stored in info["tied"].items():  # tied parameters: one tensor under each of their keys
        state[alias] = state[stored]
    order = list(shapes)  # the model's own key order
    keys = _under(prefix, sorted(state, key=lambda k: order.index(k) if k in order else len(order)), path)
    return {k[len(prefix):]: state[k] for k in keys}


def consolidate_to_safetensors(path: os.PathLike | str, out: os.PathLike | str, prefix: str = "") -> tuple[int, int]:
    """Write the single-device state dict of the sharded checkpoint ``path`` (as :func:`consolidate` returns it with
    ``prefix``, tied keys included) to the safetensors file ``out``, one tensor at a time: each is read whole from the shards
    (DCP), written and dropped, so memory holds the largest tensor at most. Published atomically. Returns
    ``(tensors, bytes)`` written.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: from :func:`~.trainer_checkpoint.read_trainer_state`.
        ImportError: never (the file is written without the safetensors package).
    """
    path, out = Path(path), Path(out)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint directory (no .metadata inside).")
    verified(path)
    info = read_trainer_state(path)[FORMAT_KEY]
    shapes, tied = info["single_device_shapes"], info["tied"]
    saved = {k[len(MODEL_PREFIX):]: v for k, v in read_metadata(path).state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    stored = {key: tied.get(key, key) for key in _under(prefix, list(shapes), path) if tied.get(key, key) in saved}
    entries = [TensorEntry(key[len(prefix):], saved[source].properties.dtype, tuple(shapes[key]))
               for key, source in stored.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    try:
        with SafetensorsStreamWriter(tmp, entries) as writer:
            for entry in entries:
                source = stored[prefix + entry.name]
                meta = saved[source]
                value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                read_shards({MODEL_PREFIX + source: value}, path, no_dist=True)
                writer.write(entry.name, value.reshape(entry.shape))
                del value
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
