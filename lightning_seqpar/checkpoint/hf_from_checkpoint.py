"""A sharded checkpoint exported as the Hugging Face directory ``from_pretrained`` loads, by one process.

``python -m lightning_seqpar.checkpoint export-hf CKPT OUT_DIR [--config DIR]``. The tensors ``save_pretrained``
would write for the model's config (:func:`~lightning_seqpar.hf.models.saved_tensor_shapes`) are found in the
checkpoint under the prefix of the Hugging Face model inside the LightningModule (``model.`` for
:class:`~lightning_seqpar.models.HFCausalLMModule`; found by matching names), read one at a time from the shards of
whatever layout wrote them, and streamed into safetensors files of at most ``max_shard_size``. Memory: the largest
tensor. The config is the ``--config`` directory's or, by default, the one the checkpoint's hyperparameters record
(``HFCausalLMModule`` saves it); tokenizer and generation files come from the ``--config`` directory or the
recorded pretrained directory. Published atomically. A LoRA checkpoint (its adapters only) is exported as the PEFT
adapter directory it trained (:mod:`.peft_from_checkpoint`), its base named by ``--config`` or the recorded pretrained
directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_seqpar.checkpoint.atomic import publish, recover_stale, temporary_path
from lightning_seqpar.checkpoint.consolidate import StoredModel
from lightning_seqpar.checkpoint.destination import mark_export, refuse_export_destination
from lightning_seqpar.checkpoint.hf_export import parse_size
from lightning_seqpar.checkpoint.peft_from_checkpoint import adapter_keys, export_adapter
from lightning_seqpar.hf.models import causal_lm_config, saved_tensor_shapes
from lightning_seqpar.hf.streaming import (
    SafetensorsStreamWriter, TensorEntry, check_storable, file_names, finish_directory, split_into_files,
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
                            max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None,
                            overwrite: bool = False, allow_unverified: bool = False) -> Path:
    """Write the Hugging Face model held by the sharded checkpoint ``checkpoint`` as the directory ``out`` (see the
    module). Returns ``out``: new, empty, or a previous export replaced with ``overwrite``; never the checkpoint's
    folder (or one holding it) or the model directory (:mod:`lightning_seqpar.checkpoint.destination`).

    Raises:
        FileNotFoundError: not a complete sharded checkpoint.
        FileExistsError: a destination that must not be written, before anything is read.
        ValueError: a file that is not as written; no config (neither ``config_dir`` nor recorded); a tensor
            missing or of another shape than the config's model, naming it; a bad ``max_shard_size`` or dtype.
    """
    refuse_export_destination(out, overwrite=overwrite, protected=(checkpoint, config_dir))
    if Path(out).parent.is_dir():
        recover_stale(Path(out).parent)  # what exports (and other writers) killed earlier left there
    stored, out = StoredModel(checkpoint, allow_unverified), Path(out)
    try:
        return _export(stored, out, config_dir, max_shard_size, dtype, overwrite)
    finally:
        stored.close()


def _export(stored: StoredModel, out: Path, config_dir: Optional[Union[str, os.PathLike]],
            max_shard_size: Union[int, str], dtype: Optional[torch.dtype], overwrite: bool) -> Path:
    checkpoint = stored.path
    hparams = stored.trainer_state.get("hyper_parameters") or {}
    if adapter_keys(stored.shapes):  # LoRA: the adapters (the frozen base is the pretrained directory's)
        return export_adapter(stored, out, None if config_dir is None else str(config_dir), overwrite)
    if config_dir is not None:
        config = causal_lm_config(pretrained=str(config_dir))
        source: Optional[Path] = Path(config_dir)
    elif isinstance(hparams.get("config"), dict):
        config = causal_lm_config(config={k: v for k, v in hparams["config"].items() if k != "transformers_version"})
        source = Path(hparams["pretrained"]) if hparams.get("pretrained") else None
    else:
        raise ValueError(f"{stored.path} records no Hugging Face config (it was not written by HFCausalLMModule): "
                         f"pass --config DIR, the model directory it was trained from.")
    refuse_export_destination(out, overwrite=overwrite, protected=(checkpoint, source))  # the model it came from
    expected = saved_tensor_shapes(config)
    prefix = find_prefix(expected, stored.shapes)
    entries = []
    for name, shape in expected.items():
        if tuple(stored.shapes[prefix + name]) != shape:
            raise ValueError(f"'{prefix + name}' is {tuple(stored.shapes[prefix + name])} in the checkpoint but {shape} "
                             f"in the config's model: pass --config with the model directory it was trained from.")
        entries.append(TensorEntry(name, dtype or stored.dtype(prefix + name), shape))
    check_storable(entries)
    files = split_into_files([entries], parse_size(max_shard_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    tmp.mkdir()
    try:
        for name, file in zip(file_names(len(files)), files):
            with SafetensorsStreamWriter(tmp / name, file) as writer:
                for entry in file:
                    writer.write(entry.name, stored.read(prefix + entry.name).to(entry.dtype))
        finish_directory(tmp, files, config, source)
        mark_export(tmp, str(checkpoint))
        refuse_export_destination(out, overwrite=overwrite, protected=(checkpoint, config_dir, source))
        stored.close()  # the checkpoint is read: its folder's lock is released before publishing (perhaps there)
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
