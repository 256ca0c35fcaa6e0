"""Give a module built on the meta device real weights, one single-device submodule at a time.

A model built under ``SeqParallelStrategy.model_sharded_context()`` (Lightning's ``configure_model``) has no
storage. The rewrite builds each parallel block on the meta device, allocates this rank's shards, then
materializes the single-device block one submodule at a time, copies its slices in and releases it, so a
rank holds its shards plus one single-device submodule at most (shards first: the transient tensors then
reuse the same memory each time, instead of leaving holes between shards). Every rank draws a submodule's
initial values from the same seed (the strategy's seed and the submodule's qualified name), so the shards of
one tensor on different ranks come from the same full tensor and no broadcast is needed.

With a ``source`` (single-device weights, e.g. a Hugging Face directory read lazily), every tensor found there
is read straight into its shard (only this rank's rows), with no random initialization first; the rest (keys
the source lacks, non-persistent buffers such as rotary ``inv_freq``) is drawn with the owning model's
initializer. Parameters shared by several modules (tied embeddings) stay shared.
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn

from lightning_seqpar._compat import reset_multihead_attention
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.sharding import load_from_full
from lightning_seqpar.parallel.placement import parameter_like

Initializer = Callable[[nn.Module, str], None]
ShardGroups = Union[ParallelGroup, Callable[[torch.Tensor], ParallelGroup]]
"""The group a tensor's shards are split over: one group for all (tensor parallel), or a tensor → its group (experts
over the expert-parallel group: :meth:`~lightning_seqpar.transformer.context.RewriteContext.shard_group`)."""


InnerGroups = Optional[Callable[[torch.Tensor], Optional[ParallelGroup]]]
"""A tensor → the group of its second split (an expert's width over expert tensor parallelism,
:meth:`~lightning_seqpar.transformer.context.RewriteContext.inner_shard_group`); ``None``: nothing is split twice."""


def _group_of(groups: ShardGroups, target: torch.Tensor) -> ParallelGroup:
    return groups if isinstance(groups, ParallelGroup) else groups(target)


def _inner_group_of(groups: InnerGroups, target: torch.Tensor) -> Optional[ParallelGroup]:
    return None if groups is None else groups(target)


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Give the memory of freed transient tensors back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    glibc keeps freed heap memory resident, in every thread's arena, and after freeing a large block raises its
    mmap threshold so that later blocks of that size come from the heap: the single-device submodules
    materialized one after another would otherwise leave up to a whole model's worth resident on a rank.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
"""``init(module, qualified_name)``: initialize ``module``'s own parameters and buffers (not its children's)."""


def to_empty(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """``module.to_empty(device=...)`` made of :func:`~lightning_seqpar.tensor_parallel.sharding.parameter_like`: each
    new parameter is built with its predecessor's roles (leaving the meta device needs new ``Parameter`` objects),
    and a parameter shared by several modules stays one parameter."""
    made: dict[int, nn.Parameter] = {}
    for owner in (module.modules() if recurse else [module]):
        for name, param in list(owner.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in made:
                made[id(param)] = parameter_like(param, torch.empty_like(param, device=device))
            setattr(owner, name, made[id(param)])  # an existing parameter's slot: replaced in place
        for name, buffer in list(owner.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(owner, name, torch.empty_like(buffer, device=device))  # keeps the buffer's persistence


def _unstored_buffers(module: nn.Module) -> bool:
    """Whether ``module`` owns buffers no state dict holds (non-persistent: computed by its initializer)."""
    persistent = {key for key in module.state_dict(keep_vars=True) if "." not in key}
    return any(key not in persistent for key, _ in module.named_buffers(recurse=False))


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (or its children) is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def reset_own_parameters(module: nn.Module, name: str) -> None:
    """The module's own initializer: ``reset_parameters()`` (torch's layers), ``MultiheadAttention``'s.

    Raises:
        ValueError: ``module`` has parameters or buffers of its own but no initializer.
    """
    if isinstance(module, nn.MultiheadAttention):
        reset_multihead_attention(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        raise ValueError(
            f"'{name or type(module).__name__}' ({type(module).__name__}) was built on the meta device (configure_model) "
            f"but has no reset_parameters() to initialize it. Give it one, or build it in __init__."
        )


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on the meta device (``requires_grad`` and ties kept;
    nothing of its memory copied): what a plan rewrites to read the parallel layers' sizes without building them."""
    import copy

    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


@dataclass
class Materializer:
    """Materializes meta-device modules on ``device``, seeded per module name so every rank agrees.

    Attributes:
        seed: the run's base seed (the same on every rank).
        device: where the single-device block is materialized before slicing (the CPU: one block).
        initializers: ``(qualified name, initializer)`` of the models that initialize their own submodules (e.g.
            Hugging Face's ``_init_weights``); a submodule takes the one of the longest name containing it, else
            the initializer the policy gave, else :func:`reset_own_parameters`.
        source: single-device values by qualified state-dict key (tensors or lazy readers, see
            :func:`~lightning_seqpar.tensor_parallel.sharding.load_from_full`), read instead of initializing.
    """

    seed: int
    device: torch.device = torch.device("cpu")
    initializers: list[tuple[str, Initializer]] = field(default_factory=list)
    source: Optional[Mapping[str, Any]] = None
    pending: list[tuple[nn.Module, nn.Module, str, Optional[Initializer]]] = field(default_factory=list)
    """(parallel skeleton, single-device block on meta, name, initializer) left by the rewrite for :meth:`fill`"""

    def __call__(self, module: nn.Module, name: str, init: Optional[Initializer] = None) -> None:
        """Materialize ``module`` (qualified name ``name``) if it has meta tensors; ``init`` defaults to
        :func:`reset_own_parameters`, applied to every submodule, children before parents (the order
        their constructors ran: ``MultiheadAttention`` re-initializes its ``out_proj`` bias after it).

        Raises:
            ValueError: from :func:`reset_own_parameters`.
        """
        if not has_meta_tensors(module):
            return
        to_empty(module, self.device)
        for sub_name, sub in reversed(list(module.named_modules())):
            self._initialize(sub, f"{name}.{sub_name}" if sub_name else name, init)

    def _initialize(self, module: nn.Module, name: str, init: Optional[Initializer]) -> None:
        owner = max((entry for entry in self.initializers if name == entry[0] or name.startswith(entry[0] + ".")
                     or not entry[0]), key=lambda entry: len(entry[0]), default=None)
        # The same values on every rank, whatever else this rank has drawn: a seed per submodule name.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed + zlib.crc32(name.encode()))
            (owner[1] if owner is not None else init or reset_own_parameters)(module, name)

    def _from_source(self, module: nn.Module, name: str) -> Optional[dict[str, Any]]:
        """``module``'s own tensors as the source holds them (by local key), or ``None`` when the source lacks any
        of them (non-persistent buffers are never in a state dict: such a module is initialized)."""
        if self.source is None:
            return None
        # Own persistent tensors only: a non-persistent buffer (Gemma's embed_scale, rotary inv_freq) is never stored
        # and is not the parallel module's either.
        keys = [key for key in module.state_dict(keep_vars=True) if "." not in key]
        if not keys:  # non-persistent buffers only (rotary inv_freq): computed by the module's initializer
            return None
        found = {key: self.source.get(f"{name}.{key}" if name else key) for key in keys}
        return found if all(v is not None for v in found.values()) else None

    def into(self, parallel: nn.Module, original: nn.Module, name: str, group: ShardGroups,
             init: Optional[Initializer] = None, inner: InnerGroups = None) -> None:
        """Fill ``parallel``'s tensors (same state-dict keys as ``original``) from ``original`` on the meta device:
        each submodule of ``original`` is materialized, sliced into ``parallel`` and released in turn, so at most
        one single-device submodule (e.g. one Linear) exists at a time. Submodules ``parallel`` reuses as they
        are (norms) are materialized in place.
        """
        shared = {id(m) for m in parallel.modules()}
        targets = parallel.state_dict(keep_vars=True)
        with torch.no_grad():
            for sub_name, sub in reversed(list(original.named_modules())):
                if not any(True for _ in sub.parameters(recurse=False)) and not any(True for _ in sub.buffers(recurse=False)):
                    continue  # every tensor here was on the meta device; shared ones were just allocated empty
                qualified = f"{name}.{sub_name}" if sub_name else name
                stored = self._from_source(sub, qualified)
                if stored is not None and id(sub) not in shared:  # straight from the source into the shards
                    for key, value in stored.items():
                        target = targets[f"{sub_name}.{key}" if sub_name else key]
                        load_from_full(target, value, _group_of(group, target), _inner_group_of(inner, target))
                    continue
                to_empty(sub, self.device, recurse=False)
                if stored is None or _unstored_buffers(sub):  # computed buffers (Gemma's embed_scale) need init
                    self._initialize(sub, qualified, init)
                if stored is not None:
                    self._copy_from(sub, stored, None)  # the single-device submodule: whole tensors
                if id(sub) in shared:
                    continue  # the parallel block holds this very module
                for key, value in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
                    target = targets.get(f"{sub_name}.{key}" if sub_name else key)
                    if target is not None:  # a non-persistent buffer of the original the parallel module computes
                        load_from_full(target, value, _group_of(group, target), _inner_group_of(inner, target))
                to_empty(sub, torch.device("meta"), recurse=False)  # released

    def fill(self, model: nn.Module, group: ShardGroups, inner: InnerGroups = None) -> None:
        """Allocate the shards of every pending block still in ``model`` (the stage split dropped the others),
        then fill them block by block (:meth:`into`); last, materialize the modules no policy rewrote. All
        shards first: the transient single-device submodules then reuse one region of memory instead of
        leaving holes between shards.

        Raises:
            ValueError: from :func:`reset_own_parameters`.
        """
        present = {id(m) for m in model.modules()}
        params = {id(p) for p in model.parameters()}
        # A block the stage split dropped is still filled when the model shares a parameter of it (a tied embedding
        # whose LM head is on this stage): the tie is restored by ``_remaining``.
        kept = [entry for entry in self.pending
                if id(entry[0]) in present or any(id(p) in params for p in entry[0].parameters())]
        materialized: dict[int, nn.Parameter] = {}  # a meta parameter → its allocated one (ties stay ties)
        for parallel, *_ in kept:
            before = dict(parallel.named_parameters())
            to_empty(parallel, self.device)
            materialized.update({id(p): getattr(parallel.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
                                 for n, p in before.items()})
        for parallel, original, name, init in kept:
            self.into(parallel, original, name, group, init, inner)
            release_freed_memory()
        self.pending.clear()
        self._remaining(model, materialized)
        release_freed_memory()

    def _remaining(self, model: nn.Module, materialized: dict[int, nn.Parameter]) -> None:
        """Materialize every module of ``model`` that still owns meta tensors (those no policy rewrote),
        each with its own initializer.

        Raises:
            ValueError: from :func:`reset_own_parameters`.
        """
        # ``materialized``: a shared (tied) meta parameter → its materialized one
        for name, module in model.named_modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if not own or not all(t.is_meta for t in own):
                continue
            params = dict(module.named_parameters(recurse=False))
            if params and not any(True for _ in module.buffers(recurse=False)) and all(
                    id(p) in materialized for p in params.values()):
                for key, param in params.items():  # tied to a parameter materialized already: stays tied
                    setattr(module, key, materialized[id(param)])
                continue
            stored = self._from_source(module, name)
            to_empty(module, self.device, recurse=False)
            if stored is None or _unstored_buffers(module):
                self._initialize(module, name, None)
            if stored is not None:
                self._copy_from(module, stored, None)
            for key, param in params.items():
                materialized[id(param)] = getattr(module, key)

    @staticmethod
    def _copy_from(module: nn.Module, stored: dict[str, Any], group: Optional[ParallelGroup]) -> None:
        """Copy the source's values into ``module``'s own (single-device, just allocated) tensors."""
        own = dict([*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
        for key, value in stored.items():
            load_from_full(own[key], value, group or ParallelGroup())


