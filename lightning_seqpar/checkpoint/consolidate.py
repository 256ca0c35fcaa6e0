"""A sharded checkpoint as the single-device state dict, without any process group.

``consolidate`` reads every ``state_dict.*`` tensor of a sharded checkpoint directory whole (DCP assembles
each from the shards of whatever layout wrote it), restores each single-device shape recorded in the
checkpoint (fused q/k/v is stored ``[3, n, ...]``) and returns what the original, unparallelized
module's ``load_state_dict`` accepts. The whole model is in host memory once: this is for export.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.checkpoint.safe_reader import SafeFileSystemReader, read_metadata
from lightning_seqpar.checkpoint.sharded import FORMAT_KEY, MODEL_PREFIX, is_sharded_checkpoint
from lightning_seqpar.checkpoint.trainer_checkpoint import read_trainer_state


def consolidate(path: os.PathLike | str) -> dict[str, Tensor]:
    """The single-device model state dict held by the sharded checkpoint directory ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no ``.metadata``).
        ValueError: from :func:`~.trainer_checkpoint.read_trainer_state`.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint directory (no .metadata inside).")
    info = read_trainer_state(path)[FORMAT_KEY]
    shapes = info["single_device_shapes"]
    metadata = read_metadata(path)
    saved = {k: v for k, v in metadata.state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in saved.items()}
    dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=True)
    state = {k[len(MODEL_PREFIX):]: v.reshape(shapes[k[len(MODEL_PREFIX):]]) for k, v in targets.items()}
    for alias, stored in info["tied"].items():  # tied parameters: one tensor under each of their keys
        state[alias] = state[stored]
    order = list(shapes)  # the model's own key order
    return {k: state[k] for k in sorted(state, key=lambda k: order.index(k) if k in order else len(order))}


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
            try:
                from safetensors.torch import save_file
            except ImportError as error:
                raise ImportError("Writing .safetensors needs the safetensors package: pip install safetensors "
                                  "(or lightning_seqpar[hf]).") from error
            stored: set[int] = set()
            tensors = {}
            for key, value in state_dict.items():  # safetensors refuses shared memory: a tied weight is copied
                value = value.contiguous()
                tensors[key] = value.clone() if value.data_ptr() in stored else value
                stored.add(value.data_ptr())
            save_file(tensors, str(tmp))
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
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    return state if names is None else {k: v for k, v in state.items() if k in names}
