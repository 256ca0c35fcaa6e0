"""Sharded checkpoints: every rank writes and reads only its own shards, through ``torch.distributed.checkpoint``.

A checkpoint is a directory holding DCP's files (one ``__R_0.distcp`` per writing rank and the index
``.metadata``) and ``trainer_state.pt``, the rest of Lightning's checkpoint (loops, schedulers,
callbacks, hyperparameters) plus what a reader needs without the model: the single-device shape of
every weight and each optimizer's hyperparameters.

Keys are the single-device names, so any layout reads any other (DCP reshards on load):

- ``state_dict.<name>``: each entry of the model's ``state_dict()``, global shape (fused q/k/v stored
  ``[3, n, ...]``, see :mod:`.layout`), vocabulary padding left out;
- ``optimizer_states.<i>.state.<parameter name>.<key>``: the per-parameter optimizer state (AdamW's
  ``step``, ``exp_avg``, ``exp_avg_sq``), keyed by parameter *name*, not by position, so a pipeline
  stage finds its parameters' state whatever layout wrote it; with ``zero=1`` each data-parallel rank writes its
  element ranges in place, as chunks of the same global tensor (the optimizer's own entries, :class:`ShardsItsState`),
  so either ``zero`` reads what the other wrote.

Saving is collective over the process group given; replicated tensors (data-parallel copies, modules
every pipeline stage holds) are written once, by the rank DCP's deduplication picks.
"""

from __future__ import annotations

import warnings

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_seqpar.checkpoint.checks import check_finite, on_every_rank
from lightning_seqpar.checkpoint.safe_reader import METADATA_FILE, SafeFileSystemReader
from lightning_seqpar.tensor_parallel.dcp_ranges import MAIN_PARAM
from lightning_seqpar.tensor_parallel.sharding import ShardMeshes, dcp_view, full_shape, saved_shape
from lightning_seqpar.parallel.placement import inner_spec, shard_spec

MODEL_PREFIX = "state_dict."
OPTIMIZER_PREFIX = "optimizer_states."
TRAINER_STATE_FILE = "trainer_state.pt"
FORMAT_KEY = "lightning_seqpar"
FORMAT = "sharded-dcp-1"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory (DCP writes its index last)."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def local_part(tensor: Any) -> Tensor:
    """The rank's own memory behind a DCP view: a :func:`~lightning_seqpar.tensor_parallel.sharding.dcp_view`'s local
    shard, an element range's pieces (:func:`~lightning_seqpar.tensor_parallel.dcp_ranges.dcp_range_view`) flattened
    together, the tensor itself when replicated."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    if hasattr(tensor, "local_shards"):
        pieces = [shard.tensor.reshape(-1) for shard in tensor.local_shards()]
        return torch.cat(pieces) if pieces else torch.zeros(0)
    return tensor


def read_shards(targets: dict[str, Tensor], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` of ``targets`` from ``path``; its failures (``CheckpointException`` derives from
    ``BaseException``, which ``except Exception`` misses) become a ``ValueError`` naming the checkpoint.

    Raises:
        ValueError: a shard that cannot be read, with what DCP reported.
    """
    try:
        with warnings.catch_warnings():
            if no_dist:  # DCP warns that it reads in one process, which is what no_dist asks for
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=no_dist)
    except CheckpointException as error:
        raise ValueError(f"Reading the shards of {path} failed ({str(error)[:500]}): the checkpoint is damaged. Resume "
                         f"from the checkpoint before it, or run `python -m lightning_seqpar.checkpoint verify` on it.") from error


# ---------------------------------------------------------------------------------------------- model
def _unique_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``module.state_dict(keep_vars=True)`` with each tied parameter under its first key only, and the
    other keys as ``{alias: first key}`` (tied embeddings: stored once, as ``torch.save`` would)."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, value in module.state_dict(keep_vars=True).items():  # keep_vars: parameters carry their shard spec
        if not isinstance(value, Tensor):
            raise TypeError(f"state_dict entry '{name}' is a {type(value).__name__}, not a tensor: sharded checkpoints "
                            f"hold tensors only. Use CheckpointConfig(format='full') for this model.")
        if isinstance(value, nn.Parameter) and id(value) in first:
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        unique[name] = value
    return unique, aliases


def model_entries(module: nn.Module, meshes: ShardMeshes) -> dict[str, Tensor]:
    """``module.state_dict()`` as DCP must see it: values are :func:`~lightning_seqpar.tensor_parallel.sharding.dcp_view` views, a tied
    parameter under its first key only (:func:`tied_aliases` gives the others).

    Raises:
        TypeError: a state-dict entry that is not a tensor (``get_extra_state``), which DCP would pickle.
    """
    unique, _ = _unique_tensors(module)
    return {name: dcp_view(value, shard_spec(value), meshes(value), inner_spec(value)) for name, value in unique.items()}


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{state-dict key: key it is stored under}`` for the keys of tied parameters left out of the checkpoint."""
    return _unique_tensors(module)[1]


def single_device_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Each state-dict key's single-device shape (recorded in the checkpoint: fused weights are saved reshaped)."""
    return {name: list(full_shape(value)) for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, Tensor)}


def _expected_shape(value: Tensor) -> tuple[int, ...]:
    return saved_shape(shard_spec(value), full_shape(value))


def load_model(module: nn.Module, path: Path, metadata: Metadata, meshes: ShardMeshes, strict: bool,
               allow_non_finite: bool, frozen: frozenset[str] = frozenset()) -> None:
    """Read this rank's shards of ``module`` from the sharded checkpoint ``path``, in place (collective).

    Checked on every rank before anything is read: with ``strict``, every key of this rank's state dict
    is in the checkpoint (but ``frozen``: the frozen base a checkpoint left out, read again from its directory),
    and no checkpoint weight is unknown to every rank; every shape is the saved one.

    Raises:
        ValueError: a missing/unexpected key or a shape mismatch (raised on every rank), a non-finite
            value after loading (unless ``allow_non_finite``).
    """
    saved = {k[len(MODEL_PREFIX):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)}
    own, _ = _unique_tensors(module)
    everyone: list[Any] = [set(own)]
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different keys
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, set(own))

    def check() -> None:
        missing = sorted(set(own) - set(saved) - frozen)
        unexpected = sorted(set(saved) - set().union(*everyone))
        if strict and (missing or unexpected):
            raise ValueError(
                f"The checkpoint {path} does not hold this model's weights. Missing: {missing[:8]}; unexpected: "
                f"{unexpected[:8]}. Load it into the model it was saved from, or set strict_loading=False on the "
                f"LightningModule to load the matching keys only."
            )
        wrong = [f"'{k}': checkpoint {tuple(saved[k].size)}, model {_expected_shape(v)}" for k, v in own.items()
                 if k in saved and isinstance(saved[k], TensorStorageMetadata)
                 and tuple(saved[k].size) != _expected_shape(v)]
        if wrong:
            raise ValueError(
                f"The checkpoint does not fit this model ({len(wrong)} tensor(s) of another shape): {'; '.join(wrong[:8])}. "
                f"It was written for a model of another size (e.g. n_embd, n_layer, vocab_size); build the model with "
                f"the checkpoint's configuration."
            )

    on_every_rank(check)
    targets = {MODEL_PREFIX + k: dcp_view(v, shard_spec(v), meshes(v), inner_spec(v)) for k, v in own.items()
               if k in saved}
    with torch.no_grad():
        read_shards(targets, path)
    if not allow_non_finite:
        on_every_rank(lambda: check_finite({k: local_part(v) for k, v in targets.items()}, "weight"))


# ---------------------------------------------------------------------------------------------- optimizer
def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) → name`` (a tied parameter keeps its first name, as in ``named_parameters()``)."""
    return {id(p): name for name, p in module.named_parameters()}


@runtime_checkable
class ShardsItsState(Protocol):
    """An optimizer that describes its own state to the checkpoint (the distributed optimizer: each rank's element
    ranges, written and read in place)."""

    def checkpoint_entries(self, names: Mapping[int, str], meshes: Any) -> dict[str, Tensor]:
        """``{"<parameter name>.<key>": DCP view}`` of this rank's state (no communication)."""

    def checkpoint_targets(self, saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]], names: Mapping[int, str],
                           meshes: Any) -> tuple[dict[str, Tensor], Callable[[Sequence[Mapping[str, Any]]], None]]:
        """DCP targets for the saved ``{"<name>.<key>": (shape, dtype)}`` and the call that installs what was read."""


def optimizer_entries(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                      meshes: ShardMeshes) -> dict[str, Tensor]:
    """This rank's per-parameter optimizer state as DCP must see it: ``{"<name>.<key>": view}`` (an optimizer that
    :class:`ShardsItsState` gives its own). No communication.

    Raises:
        TypeError: a non-tensor state value (e.g. LBFGS's), or a parameter the module does not name.
    """
    if isinstance(optimizer, ShardsItsState):
        return optimizer.checkpoint_entries(names, meshes)
    entries = {}
    for param, state in optimizer.state.items():
        if id(param) not in names:
            raise TypeError("The optimizer holds a parameter that is not the LightningModule's: sharded checkpoints key "
                            "optimizer state by parameter name. Optimize the module's own parameters.")
        for key, value in state.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"Optimizer state '{key}' of '{names[id(param)]}' is a {type(value).__name__}: sharded "
                                f"checkpoints hold tensors only. Use CheckpointConfig(format='full').")
            like_param = value.shape == param.shape and param.dim() > 0
            entries[f"{names[id(param)]}.{key}"] = dcp_view(value, shard_spec(param) if like_param else None,
                                                            meshes(param), inner_spec(param) if like_param else None)
    return entries


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (``lr``, ``betas``, ...), without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_optimizer(index: int, optimizer: torch.optim.Optimizer, groups: Sequence[Mapping[str, Any]],
                   names: Mapping[int, str], path: Path, metadata: Metadata, meshes: ShardMeshes,
                   allow_non_finite: bool) -> None:
    """Read the state of the parameters this rank optimizes from the sharded checkpoint ``path`` (collective).

    State tensors are allocated from the checkpoint's index (a tensor shaped like its parameter is this
    rank's shard of it; others, like ``step``, whole), filled by DCP, and handed to ``load_state_dict``;
    ``groups`` (the saved hyperparameters) replace each group's settings.

    Raises:
        ValueError: another number of parameter groups; a non-finite value (unless ``allow_non_finite``).
    """
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer {index} has {len(groups)} parameter groups; this run's has "
                         f"{len(optimizer.param_groups)}. Resume with the optimizer configuration it was saved with.")
    prefix = f"{OPTIMIZER_PREFIX}{index}.state."
    saved = {k[len(prefix):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if isinstance(optimizer, ShardsItsState):
        shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in saved.items() if isinstance(v, TensorStorageMetadata)}
        own, finish = optimizer.checkpoint_targets(shapes, names, meshes)
        targets = {prefix + k: v for k, v in own.items()}
        with torch.no_grad():
            read_shards(targets, path)
        if not allow_non_finite:
            on_every_rank(lambda: check_finite({k: local_part(v) for k, v in targets.items()}, f"optimizer {index} state"))
        finish(groups)
        return
    targets: dict[str, Tensor] = {}
    state: dict[Tensor, dict[str, Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[id(param)]
            entry = {}
            for key, meta in saved.items():
                head, _, field = key.rpartition(".")
                if head != name or not isinstance(meta, TensorStorageMetadata):
                    continue
                if field == MAIN_PARAM:  # zero=0 updates the parameters themselves
                    continue
                if param.dim() > 0 and tuple(meta.size) == saved_shape(shard_spec(param), full_shape(param)):
                    value = torch.zeros_like(param, dtype=meta.properties.dtype)
                    targets[prefix + key] = dcp_view(value, shard_spec(param), meshes(param), inner_spec(param))
                else:
                    value = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
                    targets[prefix + key] = value
                entry[field] = value
            if entry:
                state[param] = entry
    with torch.no_grad():
        read_shards(targets, path)
    if not allow_non_finite:
        on_every_rank(lambda: check_finite({k: local_part(v) for k, v in targets.items()}, f"optimizer {index} state"))
    positions = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    live = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": {positions[id(p)]: entry for p, entry in state.items()},
                               "param_groups": [{**saved_group, "params": group["params"]}
                                                for saved_group, group in zip(groups, live)]})
