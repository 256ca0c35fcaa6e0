"""Whole-model views of sharded state: gather for checkpoints and comparisons, shard for loading.

A checkpoint written this way holds the state dict of the *unparallelized* model (same keys,
full shapes, no vocabulary padding), so it loads into any tensor-parallel layout or a single device.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import inner_spec, placement_of, shard_spec
from lightning_seqpar.tensor_parallel.sharding import gather_full, load_from_full

Shards = Union[ParallelMesh, ParallelGroup]
"""Where shards are split: a mesh (each parameter over the group its placement names) or one group for all."""


def _over(param: Tensor, shards: Shards) -> ParallelGroup:
    """The group ``param``'s shards are split over."""
    return shards.group(placement_of(param).shard_over) if isinstance(shards, ParallelMesh) else shards


def _inner_over(param: Tensor, shards: Shards) -> Optional[ParallelGroup]:
    """The group of ``param``'s second split (an expert's width over ``etp``); ``None``: split once or not. With one
    group for all, a parameter split twice raises (only a mesh names both groups)."""
    placement = placement_of(param)
    if placement.inner is None:
        return None
    if not isinstance(shards, ParallelMesh):
        raise ValueError(f"A parameter split over {placement.shard_over!r} and {placement.inner_over!r} is gathered "
                         f"over a mesh's groups, not over one group.")
    return shards.group(placement.inner_over)


def _gather(param: Tensor, value: Tensor, shards: Shards) -> Tensor:
    """The single-device tensor of ``value``, this rank's part of a tensor shaped like ``param``'s shard."""
    return gather_full(value, shard_spec(param), _over(param, shards), inner_spec(param), _inner_over(param, shards))


def full_tensor(param: Tensor, shards: Shards) -> Tensor:
    """The single-device value of ``param`` (collective over the groups its placement splits it over); a replicated
    one as it is (detached)."""
    return _gather(param, param.detach(), shards) if shard_spec(param) is not None else param.detach()


def _split(param: Tensor, full: Tensor, shards: Shards) -> Tensor:
    """This rank's part of the single-device ``full``, shaped like ``param``'s shard."""
    value = shard_spec(param).shard(full, _over(param, shards))
    inner = inner_spec(param)
    return value if inner is None else inner.shard(value, _inner_over(param, shards))


def _params_by_name(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters(remove_duplicate=False))


def full_state_dict(module: nn.Module, group: Shards) -> dict[str, Tensor]:
    """The single-device state dict of ``module``, assembled from every rank's shards (over each parameter's
    shard group of a mesh, or over ``group``).

    Collective: every rank of those groups must call it. Returns CPU tensors on every rank.
    """
    params = _params_by_name(module)
    gathered: dict[int, Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = params.get(name)
        spec = shard_spec(param)
        if spec is None:
            out[name] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
            continue
        if id(param) not in gathered:  # tied weights are gathered once
            gathered[id(param)] = _gather(param, param.detach(), group).cpu()
        out[name] = gathered[id(param)]
    return out


def full_gradients(module: nn.Module, group: Shards) -> dict[str, Tensor]:
    """Gradients of ``module``'s parameters as the unparallelized model would hold them (collective)."""
    out = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        spec = shard_spec(param)
        # A copy: on CPU .cpu() would return the live gradient, which clipping then scales in place.
        out[name] = (_gather(param, param.grad, group) if spec is not None else param.grad.detach()).cpu().clone()
    return out


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor], group: Shards, strict: bool = True) -> None:
    """Copy a single-device state dict into ``module``, keeping this rank's shard of sharded parameters.

    Raises:
        KeyError: with ``strict``, listing missing and unexpected keys.
    """
    own = module.state_dict(keep_vars=True)
    if strict:
        missing, unexpected = set(own) - set(state_dict), set(state_dict) - set(own)
        # A tied parameter is stored under one of its keys (Hugging Face omits lm_head.weight when tied).
        present = {id(own[k]) for k in own if k in state_dict}
        missing = {k for k in missing if id(own[k]) not in present}
        if missing or unexpected:
            raise KeyError(f"State dict mismatch. Missing: {sorted(missing)}; unexpected: {sorted(unexpected)}.")
    for name, target in own.items():  # keep_vars: parameters carry their shard spec
        if name in state_dict:
            load_from_full(target, state_dict[name], _over(target, group), _inner_over(target, group))


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: torch.optim.Optimizer, group: Shards) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every per-parameter tensor of a sharded parameter gathered (collective)."""
    state = optimizer.state_dict()
    # state_dict() shares the per-parameter dicts with the live optimizer: never write into them.
    state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
    params = _optimizer_params(optimizer)
    for index, entry in state["state"].items():
        spec = shard_spec(params[index])
        if spec is None:
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.shape == params[index].shape:
                entry[key] = _gather(params[index], value, group).cpu()
    return state


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], group: Shards) -> None:
    """Inverse of :func:`full_optimizer_state`: keep this rank's shard of each per-parameter tensor."""
    state = {"state": {k: dict(v) for k, v in state["state"].items()}, "param_groups": state["param_groups"]}
    params = _optimizer_params(optimizer)
    for index, entry in state["state"].items():
        spec = shard_spec(params[int(index)])
        if spec is None:
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > spec.dim and value.shape[spec.dim] == spec.full_size:
                entry[key] = _split(params[int(index)], value, group)
    optimizer.load_state_dict(state)
