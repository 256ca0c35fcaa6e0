"""The parts outside the layer stack live on the one pipeline stage that runs them.

The embedding runs before the stack, so only the first stage needs it; the final norm and the LM head run
after it, so only the last stage does (Megatron-LM's ``pre_process``/``post_process``). Elsewhere a placeholder
takes the module's place, keeping the model's code and state-dict keys:

* :class:`SkippedEmbedding` on stages after the first: it returns zeros of the embedding's output shape
  ``[*ids.shape, h]`` (an expanded scalar: no memory), which the stage's first layer replaces by the
  activation it received, so the code between the embedding and the stack (masks, rotary tables) runs as on
  the first stage, in the embedding's dtype.
* :class:`LastStageOnly` on stages before the last: a non-final stage's step ends at its last layer, so this
  never runs; if it does (the part ran before the stack after all), it raises, naming the part.

A tied embedding and LM head is one tensor held by the first and the last stage (each holds it under both
keys, as one device does) and tagged pipeline-tied: its gradient is summed between those two stages only,
Megatron-LM's embedding group (:func:`lightning_seqpar.optim.finalize_gradients`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.pipeline_parallel.stage import StageRuntime
from lightning_seqpar.parallel.placement import set_pipeline_tied, set_stage_local

FIRST, LAST = "first", "last"


class SkippedEmbedding(nn.Module):
    """An embedding held by the first pipeline stage, on a later stage: ids ``[*]`` → zeros ``[*, h]``.

    Keeps the embedding's tied weight (registered as ``weight``) when this stage holds the LM head sharing it.

    Raises (in ``forward``):
        RuntimeError: called outside a pipeline step, or after the stage's layers started (the embedding's
            output would then be used as a value, not replaced by the received activation).
    """

    def __init__(self, name: str, embedding_dim: int, dtype: torch.dtype, runtime: StageRuntime) -> None:
        super().__init__()
        self.name, self.embedding_dim, self.dtype = name, embedding_dim, dtype
        self._runtime = runtime

    def extra_repr(self) -> str:
        return f"'{self.name}' held by the first pipeline stage, h={self.embedding_dim}"

    def _apply(self, fn: Any, recurse: bool = True) -> "SkippedEmbedding":
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype  # follows .double(), .to(bfloat16), ...
        return super()._apply(fn, recurse)

    def forward(self, ids: Tensor) -> Tensor:  # an embedding's call: ids only (anything more is a TypeError)
        if not self._runtime.before_stack:
            raise RuntimeError(
                f"'{self.name}' (an embedding held by the first pipeline stage) ran on pipeline stage "
                f"{self._runtime.active} {'outside a pipeline step' if self._runtime.active is None else 'after its layers'}: "
                f"only the code before the layer stack may use it. Use pp=1 for this model, or a policy that places "
                f"this part on every stage (Policy.pipeline_placement)."
            )
        return torch.zeros((), dtype=self.dtype, device=ids.device).expand(*ids.shape, self.embedding_dim)


class LastStageOnly(nn.Module):
    """A part held by the last pipeline stage (final norm, LM head), on an earlier stage.

    Keeps the LM head's tied weight (registered as ``weight``) when this stage holds the embedding sharing it.

    Raises (in ``forward``):
        RuntimeError: always: a stage before the last ends its step at its last layer, before this part.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def extra_repr(self) -> str:
        return f"'{self.name}' held by the last pipeline stage"

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:  # refuses every call, whatever its arguments
        raise RuntimeError(
            f"'{self.name}' is held by the last pipeline stage (it runs after the layer stack), but it ran on an "
            f"earlier stage, before the stack. Use pp=1 for this model, or a policy that places this part on every "
            f"stage (Policy.pipeline_placement)."
        )


def _first_keys(model: nn.Module) -> dict[int, str]:
    """``id(tensor) → its first state-dict key`` (a tied parameter is stored under that one)."""
    first: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        first.setdefault(id(value), key)
    return first


def place_outside_stack(model: nn.Module, placement: Mapping[str, str], runtime: StageRuntime,
                        pipeline_rank: int) -> list[str]:
    """Keep the placed parts this pipeline rank runs and replace the others by placeholders, in place.

    Args:
        model: the rewritten model, its layers already split (:func:`~.stage.split_stages`).
        placement: ``{qualified path: "first" | "last"}`` (:func:`lightning_seqpar.policies.pipeline_placement`).
        runtime: the split model's runtime.
        pipeline_rank: this rank's coordinate in the pipeline group.

    Returns:
        The state-dict keys now held by other ranks (a tied tensor under its first key only).

    Parameters of the parts kept become stage-local, except a tensor shared by a first-stage and a last-stage
    part (a tied embedding), which is pipeline-tied on both stages where they are on two ranks.

    Raises:
        ValueError: a ``"first"`` part that is not an embedding (no ``embedding_dim``), a placement other than
            ``"first"``/``"last"``, or a tied tensor owned by a child of a placed part.
    """
    layout = runtime.layout
    holds = {FIRST: layout.rank_of(0) == pipeline_rank, LAST: layout.rank_of(layout.num_stages - 1) == pipeline_rank}
    parts = {path: model.get_submodule(path) for path in placement}
    for path, where in placement.items():
        if where not in holds:
            raise ValueError(f"Pipeline placement of '{path}' is {where!r}; it must be 'first' or 'last'.")
        if where == FIRST and not isinstance(getattr(parts[path], "embedding_dim", None), int):
            raise ValueError(f"'{path}' ({type(parts[path]).__name__}) is placed on the first pipeline stage, which "
                             f"needs an embedding (an embedding_dim): place only embeddings there.")
    on = {where: {id(p) for path, m in parts.items() if placement[path] == where for p in m.parameters()}
          for where in holds}
    # A tensor of both ends is summed between the first and the last stage's ranks, unless one rank holds both (the V
    # placement): there its gradient already holds both uses.
    tied = on[FIRST] & on[LAST] if layout.rank_of(0) != layout.rank_of(layout.num_stages - 1) else set()
    first_keys = _first_keys(model)
    remote: list[str] = []
    for path, module in parts.items():
        where = placement[path]
        if holds[where]:
            for p in module.parameters():
                (set_pipeline_tied if id(p) in tied else set_stage_local)(p)
            continue
        other_held = holds[LAST if where == FIRST else FIRST]
        if where == FIRST:
            weight = getattr(module, "weight", None)
            dtype = weight.dtype if isinstance(weight, Tensor) else torch.get_default_dtype()
            stand_in: nn.Module = SkippedEmbedding(path, module.embedding_dim, dtype, runtime)
        else:
            stand_in = LastStageOnly(path)
        for key, p in module.named_parameters():
            if id(p) in tied and other_held:  # this stage holds the other end of the tie: keep it under this key
                if "." in key:
                    raise ValueError(f"'{path}.{key}' is tied across pipeline stages inside a child of a placed part; "
                                     f"place the child itself.")
                set_pipeline_tied(p)
                stand_in.register_parameter(key, p)
        kept = {id(p) for p in stand_in.parameters()}
        remote += [f"{path}.{key}" for key, value in module.state_dict(keep_vars=True).items()
                   if id(value) not in kept and first_keys.get(id(value)) == f"{path}.{key}"]
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, stand_in)
    return remote
