"""Cut a rewritten model into pipeline stages without changing the user's code.

The user's ``training_step`` runs unchanged on every stage, once per micro-batch. Only the layer
stack differs: layers held by other ranks are replaced by :class:`RemoteLayer` placeholders, and the
held layers route through :class:`StageRuntime`, which

* passes the hidden state through the layers of earlier stages (their work happened elsewhere),
* swaps in the activation received from the previous stage at the first layer of the running stage,
* stops the step at the last layer of a non-final stage by raising :class:`StageOutput` with the
  tensor to send on.

So the code before the stack (embeddings) feeds the pipeline on the first stage only, and the code
after it (final norm, LM head, loss) runs on the last stage only. Parameter names, and therefore
state-dict keys, are those of the single-device model.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.pipeline_parallel.layout import StageLayout


class StageOutput(Exception):
    """Raised by the last layer of a non-final stage: ``tensor`` goes to the next stage.

    An ``Exception`` (not a ``BaseException``): ``nn.Module`` runs its ``always_call`` forward hooks only
    for those, and module-stack trackers rely on them. A model must not swallow it with ``except Exception``.
    """

    def __init__(self, tensor: Tensor) -> None:
        super().__init__()
        self.tensor = tensor


class StageRuntime:
    """Which virtual stage is running and what it received.

    Attributes:
        layout: the stage layout.
        active: virtual stage being run, ``None`` outside a pipeline step.
        incoming: activation received from the previous stage (``None`` on the first stage).
    """

    def __init__(self, layout: StageLayout) -> None:
        self.layout = layout
        self.active: Optional[int] = None
        self.incoming: Optional[Tensor] = None

    @property
    def feeds_pipeline(self) -> bool:
        """Whether the code before the stack produces the input of the running stage (the first stage).

        A model may skip its embedding when this is ``False``: the running stage's first layer replaces
        whatever reaches it by the received activation.
        """
        return self.active == 0

    def run(self, stage: int, incoming: Optional[Tensor], step: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``step`` as virtual stage ``stage``; return ``(True, tensor to send)`` or ``(False, step's result)``."""
        self.active, self.incoming = stage, incoming
        try:
            return False, step()
        except StageOutput as out:
            return True, out.tensor
        finally:
            self.active, self.incoming = None, None

    def _check(self, index: int) -> int:
        if self.active is None:
            raise RuntimeError(
                f"Transformer layer {index} was called outside a pipeline step. Under pipeline parallelism the model "
                f"runs inside training_step/validation_step/test_step only, where the strategy schedules the stages."
            )
        stage = self.layout.stage_of_layer(index)
        if stage > self.active:
            raise RuntimeError(
                f"Transformer layer {index} (stage {stage}) ran while stage {self.active} was running. Pipeline "
                f"parallelism needs the stack's layers called once each, in order, per step."
            )
        return stage

    def pass_through(self, index: int, hidden: Tensor) -> Tensor:
        """A layer of an earlier stage: its output arrives by point-to-point later, so pass the input on."""
        self._check(index)
        return hidden

    def layer(self, index: int, forward: Callable[..., Any], hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run held layer ``index`` as part of the active stage (or pass through for another chunk)."""
        stage = self._check(index)
        if stage != self.active:
            return hidden
        start, end = self.layout.bounds(stage)
        if index == start and stage > 0:
            hidden = self.incoming
        out = forward(hidden, *args, **kwargs)
        if index == end - 1 and stage < self.layout.num_stages - 1:
            if not isinstance(out, Tensor):
                raise TypeError(
                    f"Transformer layer {index} returned {type(out).__name__}; pipeline stages exchange one tensor, "
                    f"so the stack's layers must map a hidden-state tensor to a hidden-state tensor."
                )
            raise StageOutput(out)
        return out


class RemoteLayer(nn.Module):
    """Placeholder for a layer held by another pipeline rank (no parameters)."""

    def __init__(self, index: int, stage: int, runtime: StageRuntime) -> None:
        super().__init__()
        self.index, self.pipeline_stage = index, stage
        self._runtime = runtime

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.pipeline_stage}"

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._runtime.pass_through(self.index, hidden)


def find_layer_stack(model: nn.Module) -> tuple[nn.Module, list[int]]:
    """The container of the rewritten transformer layers and their indices in it.

    Raises:
        ValueError: no rewritten layer, or layers not in one ``nn.ModuleList``/``nn.Sequential`` (or
            ``nn.TransformerEncoder``) run in order.
    """
    found: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "recompute_layer"):
            parent, _, index = name.rpartition(".")
            if not index.isdigit():
                raise ValueError(
                    f"Pipeline parallelism splits a stack of layers held in an nn.ModuleList or nn.Sequential; the "
                    f"transformer layer '{name}' is a plain attribute. Put the layers in one nn.ModuleList called in order."
                )
            found.setdefault(parent, []).append(int(index))
    if not found:
        raise ValueError(
            f"Pipeline parallelism found no rewritten transformer layer in {type(model).__name__}: it splits the "
            f"layers that the tensor-parallel rewrite recognizes (the reference GPT, nn.TransformerEncoder(Layer)). "
            f"Use those blocks, or a Policy whose layers have a `recompute_layer` attribute."
        )
    if len(found) > 1:
        raise ValueError(
            f"Pipeline parallelism splits one stack of layers, but transformer layers sit in {len(found)} containers "
            f"({', '.join(repr(p) for p in found)}). Put all layers in one nn.ModuleList called in order, or use pp=1."
        )
    parent, indices = next(iter(found.items()))
    container = model.get_submodule(parent)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or indices != list(range(len(container))):
        raise ValueError(
            f"Pipeline parallelism needs '{parent}' to be an nn.ModuleList/nn.Sequential holding only the "
            f"transformer layers; it holds {len(container)} modules of which {len(indices)} are layers."
        )
    return container, indices


def split_stages(model: nn.Module, layout_for: Callable[[int], StageLayout], pipeline_rank: int) -> tuple[StageRuntime, list[str]]:
    """Keep this rank's layers of ``model`` and route them through a :class:`StageRuntime`, in place.

    Args:
        model: a rewritten model (after :func:`lightning_seqpar.rewrite`).
        layout_for: builds the :class:`StageLayout` from the number of layers found.
        pipeline_rank: this rank's coordinate in the pipeline group.

    Returns:
        The runtime, and the state-dict keys now held by other ranks.

    Modules with a ``stage_runtime`` attribute (e.g. :class:`~lightning_seqpar.transformer.gpt.ParallelGPT`)
    receive the runtime, to skip work whose result only the first stage uses. Held layers get ``pipeline_stage`` (their virtual stage); their parameters get ``pipeline_stage_local = True`` (gradients of the others are summed
    over the pipeline group, see :func:`lightning_seqpar.gradients.finalize_gradients`).

    Raises:
        ValueError: from :func:`find_layer_stack` and :meth:`StageLayout.build`.
    """
    container, indices = find_layer_stack(model)
    layout = layout_for(len(indices))
    runtime = StageRuntime(layout)
    for module in model.modules():
        if hasattr(module, "stage_runtime"):
            module.stage_runtime = runtime
    held = set(layout.stages_of(pipeline_rank))
    prefix = next(name for name, m in model.named_modules() if m is container)
    remote_keys: list[str] = []
    for index in indices:
        stage = layout.stage_of_layer(index)
        layer = container[index]
        if stage in held:
            layer.pipeline_stage = stage
            for p in layer.parameters():
                p.pipeline_stage_local = True
            # An instance attribute, not a wrapper module: parameter names stay those of one device.
            layer.forward = functools.partial(runtime.layer, index, type(layer).forward.__get__(layer))
            continue
        remote_keys += [f"{prefix}.{index}.{k}" for k in layer.state_dict()]
        container[index] = RemoteLayer(index, stage, runtime)
    return runtime, remote_keys
