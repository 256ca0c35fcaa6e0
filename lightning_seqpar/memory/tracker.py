"""Measure the bytes a forward pass leaves alive for backward, by the storages its ops created.

``saved_tensors_hooks`` only see what autograd nodes save; tensors kept by a checkpointing cache or
held as views of a larger buffer escape them. Tracking op *outputs* below autograd (a
``TorchDispatchMode``) with weak references to their storages sees everything: once the forward
returns, whatever is still alive is held by the autograd graph (or by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_seqpar._compat import TorchDispatchMode, local_tensor, storage_key


def host_rng_state(t: torch.Tensor) -> bool:
    """Whether ``t`` looks like the CPU generator's state (a ``uint8`` vector of its size), which recomputation saves
    per checkpointed region: in a GPU run it lives in host memory, so neither tracker counts it."""
    return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == _HOST_STATE_NUMEL


_HOST_STATE_NUMEL = torch.get_rng_state().numel()


@dataclass(frozen=True)
class StorageRecord:
    """One storage an op created: who made it and how big it is (plain data: safe to pickle)."""

    module: str
    """qualified name of the innermost module running when it was created ("" at the root)"""
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class LiveActivationTracker(TorchDispatchMode):
    """Record every new storage created by an op while active, attributed to the running module.

    Use as a context manager around a forward pass; afterwards (with the output still referenced)
    :meth:`live` lists what the forward left alive. Views and in-place results share an existing
    storage and are not recorded again; parameters and inputs made outside the context are never
    recorded. Recording stops when the context exits, so run ``backward`` after it.

    Args:
        model: modules whose forward calls name the records (optional; hooks are removed on exit).
    """

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.model = model
        self.records: dict[int, StorageRecord] = {}
        self._refs: dict[int, StorageWeakRef] = {}  # never leaves this process: it wraps a raw pointer
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "LiveActivationTracker":
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._push(name)))
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def _push(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(local_tensor(t).untyped_storage()) for t in operator_tensors((args, kwargs))}
        for t in operator_tensors(out):
            if t.device.type == "meta" or host_rng_state(t):
                continue
            t = local_tensor(t)  # a DTensor is a wrapper: the memory is its local shard's
            storage = t.untyped_storage()
            key = storage_key(storage)
            if key in inputs:
                continue  # a view or an in-place result
            known = self._refs.get(key)
            if known is not None and not known.expired():
                continue
            self._refs[key] = StorageWeakRef(storage)
            self.records[key] = StorageRecord(self._stack[-1] if self._stack else "", str(func.__name__),
                                              tuple(t.shape), t.dtype, storage.nbytes())
        return out

    def live(self, prefix: Optional[str] = None) -> list[StorageRecord]:
        """Records still alive, optionally only those created inside module ``prefix`` (and its children)."""
        return [r for key, r in self.records.items()
                if not self._refs[key].expired() and (prefix is None or _inside(r.module, prefix))]

    def live_bytes(self, prefix: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.live(prefix))


def operator_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or result: nested tuples, lists and dicts of them (what ATen operators
    take and return). Not ``tree_flatten``: it runs for every operator of a probe's forward, and the general pytree
    walk (namedtuples, registered classes) was a quarter of the planner's probing time."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in operator_tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in operator_tensors(item)]
    return []


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")
