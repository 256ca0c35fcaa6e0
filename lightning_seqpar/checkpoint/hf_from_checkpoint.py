"""A sharded checkpoint exported as the Hugging Face directory ``from_pretrained`` loads, by one process.

``python -m lightning_seqpar.checkpoint export-hf CKPT OUT_DIR [--config DIR]``. The tensors ``save_pretrained``
would write for the model's config (:func:`~lightning_seqpar.hf.models.saved_tensor_shapes`) are found in the
checkpoint under the prefix of the Hugging Face model inside the LightningModule (``model.`` for
:class:`~lightning_seqpar.models.HFCausalLMModule`; found by matching names), read one at a time from the shards of
whatever layout wrote them, and streamed into safetensors files of at most ``max_shard_size``. Memory: the largest
tensor. The config is the ``--config`` directory's or, by default, the one the checkpoint's hyperparameters record
(``HFCausalLMModule`` saves it); tokenizer and generation files come from the ``--config`` directory or the
recorded pretrained directory. Published atomically.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.checkpoint.hf_export import parse_size
from lightning_seqpar.checkpoint.safe_reader import read_metadata
from lightning_seqpar.checkpoint.sharded import FORMAT_KEY, MODEL_PREFIX, is_sharded_checkpoint, read_shards
from lightning_seqpar.checkpoint.trainer_checkpoint import read_trainer_state, verified
from lightning_seqpar.hf.models import causal_lm_config, saved_tensor_shapes
from lightning_seqpar.hf.streaming import (
    SafetensorsStreamWriter, TensorEntry, check_storable, copy_companion_files, file_names, split_into_files,
    write_index,
)


def find_prefix(expected: dict[str, tuple[int, ...]], stored: dict[str, Any]) -> str:
    """The prefix under which the checkpoint's keys ``stored`` hold every name of ``expected``.

    Raises:
        ValueError: no prefix holds them all, naming the first missing tensors and the keys stored.
    """
    first = next(iter(expected))
    candidates = sorted({key[: -len(first)] for key in stored if key.endswith(first)}, key=len)
    for prefix in candidates:
        if all(prefix + name in stored for name in expected):
            return prefix
    prefix = candidates[0] if candidates else ""
    missing = [name for name in expected if prefix + name not in stored][:5]
    raise ValueError(f"The checkpoint does not hold this model: {missing} (under prefix '{prefix}') are missing; it "
                     f"holds e.g. {sorted(stored)[:5]}. Pass --config with the model directory it was trained from.")


def export_checkpoint_to_hf(checkpoint: Union[str, os.PathLike], out: Union[str, os.PathLike],
                            config_dir: Optional[Union[str, os.PathLike]] = None, *,
                            max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None) -> Path:
    """Write the Hugging Face model held by the sharded checkpoint ``checkpoint`` as the directory ``out`` (see the
    module). Returns ``out``.

    Raises:
        FileNotFoundError: not a complete sharded checkpoint.
        ValueError: a file that is not as written; no config (neither ``config_dir`` nor recorded); a tensor
            missing or of another shape than the config's model, naming it; a bad ``max_shard_size`` or dtype.
    """
    path, out = Path(checkpoint), Path(out)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint directory (no .metadata inside).")
    verified(path)
    state = read_trainer_state(path)
    hparams = state.get("hyper_parameters") or {}
    if config_dir is not None:
        config = causal_lm_config(pretrained=str(config_dir))
        source: Optional[Path] = Path(config_dir)
    elif isinstance(hparams.get("config"), dict):
        config = causal_lm_config(config={k: v for k, v in hparams["config"].items() if k != "transformers_version"})
        recorded = hparams.get("pretrained")
        source = Path(recorded) if recorded and Path(recorded).is_dir() else None
    else:
        raise ValueError(f"{path} records no Hugging Face config (it was not written by HFCausalLMModule): pass "
                         f"--config DIR, the model directory it was trained from.")
    info = state[FORMAT_KEY]
    shapes, tied = info["single_device_shapes"], info["tied"]
    saved = {k[len(MODEL_PREFIX):]: v for k, v in read_metadata(path).state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    expected = saved_tensor_shapes(config)
    prefix = find_prefix(expected, shapes)
    entries = []
    for name, shape in expected.items():
        if tuple(shapes[prefix + name]) != shape:
            raise ValueError(f"'{prefix + name}' is {tuple(shapes[prefix + name])} in the checkpoint but {shape} in the "
                             f"config's model: pass --config with the model directory it was trained from.")
        stored = saved[tied.get(prefix + name, prefix + name)]
        entries.append(TensorEntry(name, dtype or stored.properties.dtype, shape))
    check_storable(entries)
    files = split_into_files([entries], parse_size(max_shard_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    tmp.mkdir()
    try:
        for name, file in zip(file_names(len(files)), files):
            with SafetensorsStreamWriter(tmp / name, file) as writer:
                for entry in file:
                    key = tied.get(prefix + entry.name, prefix + entry.name)
                    meta = saved[key]
                    value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                    read_shards({MODEL_PREFIX + key: value}, path, no_dist=True)
                    writer.write(entry.name, value.reshape(entry.shape).to(entry.dtype))
                    del value
        write_index(tmp, files)
        config.save_pretrained(str(tmp))
        if source is not None:
            copy_companion_files(source, tmp)
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
