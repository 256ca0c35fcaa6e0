"""A Lightning checkpoint (the dict ``Trainer.save_checkpoint`` builds) as a sharded checkpoint directory.

The model's and optimizers' tensors go to DCP (:mod:`.sharded`); everything else of the dict (epoch,
loops, schedulers, callbacks, hyperparameters) goes to ``trainer_state.pt``, with a ``lightning_seqpar``
entry describing the checkpoint: format version, layout that wrote it, single-device weight shapes, each
optimizer's hyperparameters. ``trainer_state.pt`` is read with ``weights_only=True``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from lightning_seqpar.checkpoint.atomic import folder_lock
from lightning_seqpar.checkpoint.manifest import MANIFEST_FILE, check_zip_file, is_zip_file, verify_on_every_rank
from lightning_seqpar.checkpoint.safe_reader import read_metadata
from lightning_seqpar.checkpoint.sharded import (
    FORMAT,
    FORMAT_KEY,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    TRAINER_STATE_FILE,
    hyperparameters,
    load_model,
    load_optimizer,
    optimizer_entries,
    parameter_names,
)
from lightning_seqpar.checkpoint.writer import ShardedCheckpointWriter
from lightning_seqpar.checkpoint.frozen_base import FrozenBase
from lightning_seqpar.tensor_parallel.sharding import ShardMeshes


def optimizer_checkpoint_state(optimizer: Optimizer, module: nn.Module, meshes: ShardMeshes) -> dict[str, Any]:
    """What ``Strategy.optimizer_state`` returns in the sharded format: ``{"state": {"<parameter name>.<key>":
    DCP view}, "param_groups": [settings without parameters]}``, this rank's part only (no communication)."""
    return {"state": optimizer_entries(optimizer, parameter_names(module), meshes),
            "param_groups": hyperparameters(optimizer)}


def save_trainer_checkpoint(writer: ShardedCheckpointWriter, checkpoint: dict[str, Any], path: Path,
                            single_device_shapes: dict[str, list[int]], tied: dict[str, str],
                            layout: dict[str, Any]) -> None:
    """Write Lightning's ``checkpoint`` (``state_dict`` and ``optimizer_states`` holding DCP views) to the
    directory ``path`` (collective). ``single_device_shapes`` must cover the whole model (every stage), and
    ``tied`` maps the state-dict keys of tied parameters left out to the key they are stored under."""
    checkpoint = dict(checkpoint)
    entries = {MODEL_PREFIX + k: v for k, v in checkpoint.pop("state_dict").items()}
    groups = None
    if "optimizer_states" in checkpoint:
        groups = []
        for index, state in enumerate(checkpoint.pop("optimizer_states")):
            entries.update({f"{OPTIMIZER_PREFIX}{index}.state.{k}": v for k, v in state["state"].items()})
            groups.append(state["param_groups"])
    checkpoint[FORMAT_KEY] = {"format": FORMAT, "layout": layout, "single_device_shapes": single_device_shapes,
                              "tied": tied, "optimizer_param_groups": groups}
    writer.save(path, entries, checkpoint)


def read_trainer_state(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """``trainer_state.pt`` of the sharded checkpoint ``path`` (``weights_only`` unless told ``False``).

    Raises:
        ValueError: the file holds objects ``weights_only`` refuses, cannot be read, or is not of this format,
            naming it.
    """
    file = Path(path) / TRAINER_STATE_FILE
    if file.is_file() and is_zip_file(file):
        check_zip_file(file)  # also for checkpoints written before manifests
    try:
        state = torch.load(file, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{file} holds objects that loading with weights_only=True refuses ({error}). If you trust the checkpoint, "
            f"pass weights_only=False to trainer.fit/validate, or allow the classes with "
            f"torch.serialization.add_safe_globals."
        ) from error
    except (OSError, EOFError, RuntimeError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise ValueError(f"{file} cannot be read ({type(error).__name__}: {error}): it is damaged or missing. "
                         f"Resume from the checkpoint before it.") from error
    if not isinstance(state, dict) or state.get(FORMAT_KEY, {}).get("format") != FORMAT:
        raise ValueError(f"{path} is not a lightning_seqpar sharded checkpoint of format {FORMAT!r}.")
    return state


def recorded_save_id(path: Path, weights_only: Optional[bool] = None) -> Optional[str]:
    """The save id ``trainer_state.pt`` of the checkpoint ``path`` records (``None``: none, or unreadable)."""
    try:
        return read_trainer_state(path, weights_only).get(FORMAT_KEY, {}).get("save_id") or None
    except ValueError:
        return None  # unreadable: refused, naming the file, when it is read


def verified(path: Path, allow_unverified: bool = False,
             weights_only: Optional[bool] = None) -> Optional[dict[str, Any]]:
    """Check every file of the sharded checkpoint ``path`` against its manifest, the ranks sharing the reading
    (collective when a process group exists). Returns the manifest.

    A checkpoint without a manifest is loaded with a warning only when it was written before manifests existed;
    one whose ``trainer_state.pt`` names a save id had a manifest, and losing it must not switch every check off:
    refused, unless ``allow_unverified`` (then loaded unchecked, with a warning).

    Raises:
        ValueError: on every rank, naming each damaged, missing or foreign file, or the missing manifest.
    """
    manifest = verify_on_every_rank(Path(path))
    if manifest is not None:
        return manifest
    save_id = recorded_save_id(Path(path), weights_only)
    if save_id is not None and not allow_unverified:
        raise ValueError(
            f"The checkpoint {path} has no {MANIFEST_FILE}, but its {TRAINER_STATE_FILE} names save {save_id}: it was "
            f"written with a manifest, which is gone, so none of its files can be checked. Restore {MANIFEST_FILE}, "
            f"resume from another checkpoint, or load it unchecked with SeqParallelStrategy("
            f"checkpointing=CheckpointConfig(allow_unverified=True)) (the checkpoint commands: --allow-unverified).")
    if not dist.is_initialized() or dist.get_rank() == 0:
        why = "its manifest is gone; loaded unchecked as asked" if save_id else "written before they existed"
        warnings.warn(f"The checkpoint {path} has no manifest ({why}): it is loaded without checking that its files "
                      f"are those written.", stacklevel=3)
    return None


def load_trainer_checkpoint(path: Path, module: nn.Module, optimizers: Sequence[Optimizer],
                            meshes: ShardMeshes, strict: bool, allow_non_finite: bool,
                            weights_only: Optional[bool] = None, allow_unverified: bool = False,
                            frozen_base: Optional[FrozenBase] = None) -> dict[str, Any]:
    """Read the sharded checkpoint ``path`` into ``module`` and (if any) ``optimizers``, in place, each rank
    its own shards (collective), and return the rest of the Lightning checkpoint for the Trainer.

    Read under a shared lock of its folder (:func:`~.atomic.folder_lock`): a job saving into that folder waits to
    publish, so the files read are all of one save. The returned dict has ``state_dict`` empty (already loaded) and, if saved, ``optimizer_states`` holding
    each optimizer's saved settings (already loaded when ``optimizers`` were given).

    ``frozen_base``: where this run read its frozen weights from; a checkpoint that left its frozen weights out
    (:mod:`~.frozen_base`) loads only when they are the same.

    Raises:
        ValueError: from :func:`verified` (before anything is read), :func:`read_trainer_state`,
            :func:`~.sharded.load_model`, :func:`~.sharded.load_optimizer`; another number of optimizers than saved;
            a checkpoint without its frozen weights whose base this run does not read from the same files.
    """
    with folder_lock(Path(path).parent, exclusive=False):  # no save replaces it while it is read
        manifest = verified(path, allow_unverified, weights_only)
        state = read_trainer_state(path, weights_only)
        info = state[FORMAT_KEY]
        if manifest is not None and info.get("save_id") != manifest["save_id"]:
            raise ValueError(f"{Path(path) / TRAINER_STATE_FILE} belongs to another save than the checkpoint's manifest "
                             f"(save {info.get('save_id')} against {manifest['save_id']}). Resume from the checkpoint before it.")
        metadata = read_metadata(path)
        load_model(module, path, metadata, meshes, strict, allow_non_finite,
                   _frozen_keys(path, info["layout"].get("frozen_base"), frozen_base))
        groups = info["optimizer_param_groups"]
        if groups is not None and optimizers:
            if len(groups) != len(optimizers):
                raise ValueError(f"The checkpoint holds {len(groups)} optimizer(s); this run has {len(optimizers)}.")
            names = parameter_names(module)
            for index, (optimizer, saved) in enumerate(zip(optimizers, groups)):
                load_optimizer(index, optimizer, saved, names, path, metadata, meshes, allow_non_finite)
    state["state_dict"] = {}
    if groups is not None:
        state["optimizer_states"] = groups
    return state


def _frozen_keys(path: Path, saved: Optional[dict[str, Any]], current: Optional[FrozenBase]) -> frozenset[str]:
    """The keys the checkpoint left out because they are the frozen base's, checked against this run's base.

    Raises:
        ValueError: the checkpoint left its frozen weights out and this run does not read them from the same files.
    """
    if saved is None:
        return frozenset()
    if current is not None and saved.get("digests"):
        current = current.with_digests()  # content, not size and time: other weights of the same shapes differ here
    why = "this run reads no frozen weights from a pretrained directory" if current is None else current.mismatch(saved)
    if why is not None:
        raise ValueError(f"The checkpoint {path} holds the trainable weights only; {why}. Resume with the model read "
                         f"from {saved['directory']} as it was (load_single_device_state_dict in configure_model), "
                         f"unchanged.")
    return frozenset(saved["keys"])
