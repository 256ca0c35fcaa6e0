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

Why an exception: the user's ``training_step`` is unchanged code that calls the whole model and then
the loss. The only way to end it at a stage boundary without running the rest (the next stages'
layers are elsewhere; the LM head would be wasted work) is to leave the call. Layers reach the
runtime through the explicit :class:`~lightning_seqpar.transformer.roles.ParallelLayer` router, not by patching
``forward``. A step that catches the exception is detected and refused (:meth:`StageRuntime.run`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.payload import NoPayload, StagePayload
from lightning_seqpar.parallel.placement import set_stage_local
from lightning_seqpar.transformer.roles import LayerStack, ParallelLayer


class StageOutput(Exception):
    """Raised by the last layer of a non-final stage: ``tensor`` goes to the next stage.

    An ``Exception`` (not a ``BaseException``): ``nn.Module`` runs its ``always_call`` forward hooks only
    for those, and module-stack trackers rely on them. A step that swallows it (``except Exception``)
    is refused with a ``RuntimeError`` by :meth:`StageRuntime.run`.
    """

    def __init__(self, tensor: Tensor) -> None:
        super().__init__()
        self.tensor = tensor


class StageRuntime:
    """Which virtual stage is running and what it received.

    Attributes:
        layout: the stage layout.
        stage_parameters: the parameters of the layers of each virtual stage this rank holds.
        active: virtual stage being run, ``None`` outside a pipeline step.
        incoming: activation received from the previous stage (``None`` on the first stage).
        payload: what the model carries between stages beside the activations
            (:class:`~lightning_seqpar.pipeline_parallel.payload.StagePayload`; :class:`NoPayload` by default).
    """

    def __init__(self, layout: StageLayout) -> None:
        self.layout = layout
        self.stage_parameters: dict[int, list[nn.Parameter]] = {}  # this rank's stages: their layers' parameters
        self.active: Optional[int] = None
        self.incoming: Optional[Tensor] = None
        self.payload: StagePayload = NoPayload()
        self._handed_on = False
        self._entered = False  # whether a layer of the stack ran in this step

    @property
    def feeds_pipeline(self) -> bool:
        """Whether the code before the stack produces the input of the running stage (the first stage).

        A model may skip its embedding when this is ``False``: the running stage's first layer replaces
        whatever reaches it by the received activation.
        """
        return self.active == 0

    @property
    def before_stack(self) -> bool:
        """Whether a pipeline step is running and has not reached the layer stack yet."""
        return self.active is not None and not self._entered

    def run(self, stage: int, incoming: Optional[Tensor], step: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``step`` as virtual stage ``stage``; return ``(True, tensor to send)`` or ``(False, step's result)``.

        Raises:
            RuntimeError: the step caught the :class:`StageOutput` raised at the stage's last layer and
                returned normally (e.g. a ``try``/``except Exception`` around the forward).
        """
        self.active, self.incoming, self._handed_on, self._entered = stage, incoming, False, False
        try:
            result = step()
        except StageOutput as out:
            return True, out.tensor
        finally:
            self.active, self.incoming = None, None
        if self._handed_on:
            raise RuntimeError(
                f"The step caught the pipeline's StageOutput raised at the last layer of stage {stage} and returned "
                f"normally. Under pipeline parallelism a non-final stage ends the step there by raising "
                f"lightning_seqpar.pipeline_parallel.StageOutput: do not catch it (re-raise it in an `except Exception:` "
                f"around the model call), or use pp=1."
            )
        return False, result

    def _check(self, index: int) -> int:
        self._entered = True
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
            self._handed_on = True
            raise StageOutput(out)
        return out


class RemoteLayer(nn.Module):
    """Placeholder for a layer held by another pipeline rank (no parameters)."""

    def __init__(self, index: int, stage: int, runtime: StageRuntime, returns_tuple: bool = False) -> None:
        super().__init__()
        self.index, self.pipeline_stage = index, stage
        self._runtime = runtime
        self.returns_tuple = returns_tuple  # the layer it stands for returns (hidden, None): so does the placeholder

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.pipeline_stage}"

    def forward(self, hidden: Tensor, *layer_args: Any, **layer_kwargs: Any) -> Any:
        # The held layer's other arguments (mask, rotary tables, cache) are checked and used by that layer on its own
        # stage, which runs the same model code with the same call; here no layer computes.
        out = self._runtime.pass_through(self.index, hidden)
        return (out, None) if self.returns_tuple else out


def find_layer_stack(model: nn.Module) -> tuple[nn.Module, list[int]]:
    """The container of the rewritten transformer layers and their indices in it.

    Raises:
        ValueError: no rewritten layer, or layers not in one ``nn.ModuleList``/``nn.Sequential`` (or
            ``nn.TransformerEncoder``) run in order.
    """
    found: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, ParallelLayer):
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
            f"Use those blocks, or a Policy whose layers are lightning_seqpar.transformer.roles.ParallelLayer."
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


def split_stages(model: nn.Module, config: PipelineConfig, pipeline_rank: int) -> tuple[StageRuntime, list[str]]:
    """Keep this rank's layers of ``model`` and route them through a :class:`StageRuntime`, in place.

    Args:
        model: a rewritten model (after :func:`lightning_seqpar.rewrite`).
        config: the pipeline configuration (its layout is built from the number of layers found).
        pipeline_rank: this rank's coordinate in the pipeline group.

    Returns:
        The runtime, and the state-dict keys now held by other ranks.

    Every :class:`~lightning_seqpar.transformer.roles.LayerStack` gets the runtime as its ``stage_position``. Held
    layers are attached to their virtual stage (``ParallelLayer.attach_pipeline_stage``) and their
    parameters become stage-local (the others' gradients are summed over the pipeline group, see
    :func:`lightning_seqpar.optim.finalize_gradients`).

    Raises:
        ValueError: from :func:`find_layer_stack` and :meth:`StageLayout.build`.
    """
    container, indices = find_layer_stack(model)
    layout = config.layout(len(indices))
    runtime = StageRuntime(layout)
    for module in model.modules():
        if isinstance(module, LayerStack):
            module.stage_position = runtime
    held = set(layout.stages_of(pipeline_rank))
    prefix = next(name for name, m in model.named_modules() if m is container)
    remote_keys: list[str] = []
    for index in indices:
        stage = layout.stage_of_layer(index)
        layer = container[index]
        if stage in held:
            layer.attach_pipeline_stage(stage, functools.partial(runtime.layer, index))
            for p in layer.parameters():
                set_stage_local(p)
            runtime.stage_parameters.setdefault(stage, []).extend(layer.parameters())
            continue
        remote_keys += [f"{prefix}.{index}.{k}" for k in layer.state_dict()]
        container[index] = RemoteLayer(index, stage, runtime, getattr(layer, "returns_tuple", False))
    return runtime, remote_keys
