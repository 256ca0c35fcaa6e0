"""Checks a checkpoint passes before anything loads from it: a user's checkpoint is their data.

Every check runs on every rank on the whole (unparallelized) state, before a single tensor is copied,
and raises ``ValueError`` naming the key and what to do: a model of another shape, non-finite values
(a corrupt file, or a run that had diverged), an optimizer state of another layout.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.tensor_parallel.sharding import full_shape

T = TypeVar("T")


def check_state_dict_shapes(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Every tensor of ``state_dict`` has the single-device shape of ``module``'s entry of the same key.

    Raises:
        ValueError: listing each mismatching key with both shapes.
    """
    wrong = []
    for name, own in module.state_dict(keep_vars=True).items():  # keep_vars: parameters carry their shard spec
        value = state_dict.get(name)
        if not hasattr(value, "shape") or not isinstance(own, Tensor):  # a tensor or a lazy reader of one
            continue
        want = full_shape(own)
        if tuple(value.shape) != want:
            wrong.append(f"'{name}': checkpoint {tuple(value.shape)}, model {want}")
    if wrong:
        raise ValueError(
            f"The checkpoint does not fit this model ({len(wrong)} tensor(s) of another shape): {'; '.join(wrong[:8])}"
            f"{' ...' if len(wrong) > 8 else ''}. It was written for a model of another size (e.g. n_embd, n_layer, "
            f"vocab_size); build the model with the checkpoint's configuration."
        )


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def check_initial_weights(module: nn.Module, source: Mapping[str, Any], strict: bool,
                          added: frozenset[str] = frozenset()) -> None:
    """Single-device weights ``source`` (tensors or lazy readers with a ``shape``) fit ``module`` before any is
    read: every shape matches, and with ``strict`` every key is known and every tensor of ``module`` is there
    (a tied parameter under one of its keys is enough; non-persistent buffers are never stored), but for
    ``added``: keys a base checkpoint cannot hold (PEFT's adapters, initialized by their own rule).

    Raises:
        ValueError: mismatching shapes (from :func:`check_state_dict_shapes`).
        KeyError: with ``strict``, unknown keys or missing tensors, naming them.
    """
    check_state_dict_shapes(module, source)
    if not strict:
        return
    own = module.state_dict(keep_vars=True)
    unknown = sorted(k for k in source if k not in own)
    by_tensor: dict[int, list[str]] = {}
    for key, tensor in own.items():
        by_tensor.setdefault(id(tensor), []).append(key)
    missing = sorted(keys[0] for keys in by_tensor.values()
                     if not any(k in source for k in keys) and not any(k in added for k in keys))
    if unknown or missing:
        raise KeyError(f"The single-device weights do not fit the model: missing {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}, unknown {unknown[:8]}{' ...' if len(unknown) > 8 else ''}. "
                       f"Check the prefix (the model's attribute path in your LightningModule, e.g. 'model.'), or pass "
                       f"strict=False to initialize what is missing with the model's own initializer.")


def check_finite(state: Any, where: str) -> None:
    """Every floating-point tensor in ``state`` (any nesting of dicts and lists) is finite.

    Raises:
        ValueError: naming the first key holding NaN or ±inf, and how many such values it holds.
    """
    for key, tensor in _tensors(state, ""):
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(
                f"The checkpoint's {where} '{key}' holds {bad} non-finite value(s) (NaN/inf) of {tensor.numel()}. The "
                f"file is corrupt or the run had diverged when it was saved; resuming would spread them to every "
                f"weight. Resume from an earlier checkpoint, or pass SeqParallelStrategy("
                f"checkpointing=CheckpointConfig(allow_non_finite=True)) to load it anyway."
            )


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], where: str) -> None:
    """``state`` (a single-device ``optimizer.state_dict()``) has this optimizer's groups and parameters.

    Raises:
        ValueError: another number of parameter groups or of parameters in a group, or a per-parameter
            state tensor whose shape is not its parameter's single-device shape.
    """
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if groups is None or "state" not in state:
        raise ValueError(f"The checkpoint's {where} is not an optimizer state dict (no 'state'/'param_groups').")
    own = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g["params"]) for g in groups]
    if own != saved:
        raise ValueError(
            f"The checkpoint's {where} holds {saved} parameters per group; this run's optimizer has {own}. It was saved "
            f"for another model or another pipeline layout; resume with the same model and layout."
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, entry in state["state"].items():
        param = params[int(index)]
        want = full_shape(param)
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() and tuple(value.shape) != want:
                raise ValueError(
                    f"The checkpoint's {where} entry {index}.{key} has shape {tuple(value.shape)}; its parameter has "
                    f"{want}. It was saved for another model; resume with the same model."
                )


def check_stage_placement(saved: Any, stages: Mapping[str, Any]) -> None:
    """A full checkpoint's record of which layers each pipeline rank held (``saved``: the strategy's mark, a mapping
    with ``"stages"``; ``True`` in checkpoints written before the record) against this run's ``stages``
    (``virtual_stages``, ``placement``, ``split``). A full checkpoint keeps each rank's optimizer state in its layers'
    order, so another placement of the same layers (1F1B's contiguous stages, the interleaved loop, ZB-V's V) would
    hand one layer's Adam moments to another of the same shape.

    Raises:
        ValueError: the record differs from ``stages``, naming both and the ways to resume.
    """
    if not isinstance(saved, Mapping) or saved.get("stages") is None or dict(saved["stages"]) == dict(stages):
        return
    raise ValueError(
        f"The checkpoint's optimizer state was saved with the pipeline's layers placed as {dict(saved['stages'])}; this "
        f"run places them as {dict(stages)}. A full checkpoint keeps each rank's optimizer state in the order of the "
        f"layers it held, so it resumes only into the same schedule's placement, virtual_stages and pipeline_split. "
        f"Resume with those, write sharded checkpoints (CheckpointConfig(format='sharded'): any layout resumes "
        f"them), or start from the weights alone (load the checkpoint's 'state_dict' and fit without ckpt_path)."
    )


def optimizer_states_of_this_stage(saved: Sequence[Mapping[str, Any]], optimizers: Sequence[torch.optim.Optimizer],
                                   pp: int, pipeline_rank: int, allow_non_finite: bool) -> list[Mapping[str, Any]]:
    """Each optimizer's single-device state for this pipeline stage, from a checkpoint's ``optimizer_states``
    (``{"pipeline_stages": [...]}`` per optimizer when written under ``pp > 1``), checked.

    Raises:
        ValueError: another number of optimizers; another pipeline layout; from :func:`check_finite`
            (unless ``allow_non_finite``) and :func:`check_optimizer_state`.
    """
    if len(saved) != len(optimizers):
        raise ValueError(f"The checkpoint holds {len(saved)} optimizer state(s); this run has {len(optimizers)}.")
    states = []
    for i, (optimizer, state) in enumerate(zip(optimizers, saved)):
        saved_pp = len(state["pipeline_stages"]) if "pipeline_stages" in state else 1
        if saved_pp != pp:
            raise ValueError(
                f"The checkpoint's optimizer state was saved with pp={saved_pp}; this run has pp={pp}. Each pipeline "
                f"stage keeps the optimizer state of its own layers, so it resumes only into the same pipeline layout. "
                f"Resume with pp={saved_pp}, or start from the weights alone: they load into any layout (load the "
                f"checkpoint's 'state_dict' into the model and fit without ckpt_path)."
            )
        if saved_pp > 1:
            state = state["pipeline_stages"][pipeline_rank]
        where = f"optimizer state {i}" + (f" (pipeline stage {pipeline_rank})" if saved_pp > 1 else "")
        if not allow_non_finite:
            check_finite(state, where)
        check_optimizer_state(optimizer, state, where)
        states.append(state)
    return states


def on_every_rank(check: Callable[[], T]) -> T:
    """Run ``check`` on this rank; if it raises ``ValueError`` on any rank, raise it on every rank.

    A rank that raised alone would leave the others waiting in their next collective. Collective over
    the default process group (a no-op wrapper without one).

    Raises:
        ValueError: the first failing rank's message, with its rank.
    """
    result: Optional[T] = None
    try:
        result = check()
        error = None
    except ValueError as failure:
        error = str(failure)
    if dist.is_available() and dist.is_initialized():
        errors: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    failed = [(rank, message) for rank, message in enumerate(errors) if message]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{message} (found on rank {rank})")
    return result  # type: ignore[return-value]
