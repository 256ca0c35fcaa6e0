"""The roles a rewritten module plays, stated once.

Gradient reduction, checkpoint state, recomputation, the memory model and the pipeline split find
what they act on through these roles and nothing else. A :class:`~lightning_seqpar.Policy` whose
replacement modules take these roles gets every feature of the strategy.

Module roles (base classes, found with ``isinstance``):

* :class:`ParallelLayer`: one rewritten transformer layer. Full recomputation checkpoints it, the
  memory model reads its sizes, the pipeline splits a list of them into stages.
* :class:`LayerStack`: a rewritten module that runs a list of :class:`ParallelLayer` itself (the
  reference GPT, ``nn.TransformerEncoder``). Full recomputation checkpoints chunks of its layers as
  one unit; under pipeline parallelism it learns which stage is running.

Parameter roles (sharded, sequence-parallel, stage-local) are tags stated beside ``ShardSpec`` in
:mod:`lightning_seqpar.tensor_parallel.sharding`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.memory.layer_memory import NO_MEMORY_POLICY, LayerMemory
from lightning_seqpar.memory.saved_tensors import Rebuild, saved_tensor_policy
from lightning_seqpar.transformer.core_attention import CoreAttention
from lightning_seqpar.transformer.mlp_slot import MLPSlot


class LayerDims(NamedTuple):
    """Single-device sizes of a transformer layer and its parallel layout, for the memory model."""

    hidden_size: int
    """h"""
    num_heads: int
    """a (query heads)"""
    ffn_hidden_size: int
    """MLP width (4h in the paper)"""
    tp: int
    """t"""
    sequence_parallel: bool
    """whether the norm/dropout/residual regions are sharded along s"""
    num_kv_heads: Optional[int] = None
    """key/value heads g (grouped-query attention); ``None``: a"""
    gated_mlp: bool = False
    """an MLP of three matrices, ``down(act(gate(x)) · up(x))`` (SwiGLU), instead of two"""


class LayerRouter(Protocol):
    """Runs a layer as part of a pipeline stage: ``router(call, hidden, *args, **kwargs)``.

    ``call`` runs the layer itself; the router may call it on ``hidden`` or on the activation
    received from the previous stage, or pass ``hidden`` through for a layer of another stage.
    """

    def __call__(self, call: Callable[..., Any], hidden: Tensor, *args: Any, **kwargs: Any) -> Any: ...


class StagePosition(Protocol):
    """What a :class:`LayerStack` may ask about the pipeline stage that is running."""

    @property
    def feeds_pipeline(self) -> bool:
        """Whether the code before the stack produces the running stage's input (the first stage)."""
        ...


_MLP_REGIONS = ("mlp", "expert_fc1", "moe_act")  # regions inside the MLP slot: recomputed with it by module


class ParallelLayer(nn.Module):
    """Role: one rewritten transformer layer.

    ``forward(hidden, *args, **kwargs)`` maps the hidden state to one of the same shape: ``[s/t, b, h]``
    (sequence parallel) or ``[s, b, h]`` between rewritten neighbours. Subclasses implement
    :meth:`layer_dims` and honour :attr:`recompute_layer` in their forward (checkpoint the whole
    layer, e.g. with :func:`lightning_seqpar.parallel.recomputed`).

    Attributes:
        memory: what the layer recomputes and offloads in backward (one frozen value, replaced whole by
            :meth:`set_memory`); :attr:`recompute_layer`, :attr:`checkpointed_whole`, :attr:`recompute_mlp`,
            :attr:`recompute_norms` and :attr:`offload` read it.
        pipeline_stage: the virtual pipeline stage holding this layer, ``None`` when not split.
        fused_attention: the layer's core attention is a fused kernel (SDPA/flash), which keeps no ``s²``
            tensor: selective recomputation has nothing to recompute in it.
        returns_tuple: the model reads the layer's output as ``outputs[0]`` (Falcon's layers return their attention
            weights beside the hidden state): a call returns ``(hidden, None)``. ``forward`` and the pipeline's
            stages exchange the tensor alone; the tuple is made last, in ``__call__``.
    """

    memory: LayerMemory = NO_MEMORY_POLICY
    compile_config: Any = None  # a CompileConfig: the body runs through torch.compile (set by compile_blocks)
    runs_offload: bool = False  # its forward enters offloading(module) around each module's region
    returns_tuple: bool = False
    fused_attention: bool = False
    pipeline_stage: Optional[int] = None
    _router: Optional[LayerRouter] = None

    @property
    def recompute_layer(self) -> bool:
        """Checkpoint the whole layer in its forward (full recomputation of a layer no stack checkpoints)."""
        return self.memory.checkpoints_itself

    @property
    def checkpointed_whole(self) -> bool:
        """Inside full recomputation, alone or in a stack's chunk: it keeps only its input."""
        return self.memory.whole

    @property
    def recompute_mlp(self) -> bool:
        """The MLP slot recomputed by module (``SelectiveRecompute(modules=["mlp"])`` or ``["moe"]``)."""
        slot = self.mlp_slot
        return slot is not None and slot.kind in self.memory.recomputed

    @property
    def recompute_norms(self) -> bool:
        """The norms' outputs rebuilt in backward (``SelectiveRecompute(modules=["layernorm"])``)."""
        return "layernorm" in self.memory.recomputed

    @property
    def offload(self) -> Any:
        """The :class:`~lightning_seqpar.offload.apply.LayerOffload` of this layer's modules, or ``None``."""
        return self.memory.offload

    def memory_refusal(self, memory: LayerMemory) -> str:
        """Why this layer cannot run ``memory``, with the fix; ``""`` when it can. The base layer runs full
        recomputation and core attention's; a subclass that enters :meth:`offloading` says so
        (:attr:`runs_offload`) and refuses what its own structure cannot run."""
        label = getattr(self, "_name", type(self).__name__)
        if memory.offload is not None and not self.runs_offload:
            return (f"Activation offload runs in the parallel blocks built from a BlockSpec; {label} is a "
                    f"{type(self).__name__}: leave ActivationOffload out for this model.")
        slot = self.mlp_slot
        if "mlp" in memory.offloaded and slot is not None and "mlp" not in slot.offload_modules:
            return (f"modules=['mlp'] offloads a dense MLP; {label} has {type(slot).__name__}: offload its input "
                    f"instead (modules=['mlp_norm']) or the experts' (modules=['expert_fc1', 'moe_act']), or leave "
                    f"'mlp' out.")
        if memory.offloaded and self.compile_config is not None:
            return (f"ActivationOffload(modules={sorted(memory.offloaded)}) with compiled blocks (compile=True): the "
                    f"offload's saved-tensor hooks run in Python, outside the compiled graph. Train with "
                    f"compile=False, or recompute instead (SelectiveRecompute(modules=...)).")
        rebuilt = sorted(memory.recomputed & {"layernorm", "moe_act"})
        if rebuilt and self.compile_config is not None:
            return (f"modules={rebuilt} with compiled blocks (compile=True): the rebuild's saved-tensor hooks run in "
                    f"Python, outside the graph. Train with compile=False, or leave {rebuilt} out.")
        if "layernorm" in memory.recomputed and not getattr(self, "norm_first", False):
            return (f"modules=['layernorm'] rebuilds the outputs of the norms before attention and MLP; {label} "
                    f"normalizes after the residual (post-norm), where the norm's output is the residual stream: "
                    f"leave 'layernorm' out.")
        conflict = memory.conflict()
        return f"{label}: {conflict.message(memory.offloaded)}" if conflict is not None else ""

    def set_memory(self, memory: LayerMemory) -> None:
        """Make ``memory`` this layer's policy and hand its parts theirs: each core attention whether it recomputes,
        the MLP slot what it recomputes and offloads inside itself.

        Raises:
            ValueError: :meth:`memory_refusal`'s reason; the layer keeps its policy.
        """
        refusal = self.memory_refusal(memory)
        if refusal:
            raise ValueError(refusal)
        self.memory = memory
        for module in self.modules():
            if isinstance(module, CoreAttention):
                module.recompute = "core_attn" in memory.recomputed
        slot = self.mlp_slot
        if slot is not None:
            within = [n for n in memory.recomputed if n in slot.recompute_modules and n != slot.kind]
            slot.recompute_within(() if self.recompute_mlp else within)
            slot.offload_within(self.offloading if memory.offloaded & set(slot.offload_modules) else None)

    def offloading(self, module: str, *shared: Optional[Tensor], rebuild: Optional[Rebuild] = None) -> Any:
        """A context for the region of ``module``: the tensors autograd saves there are offloaded to host memory when
        :attr:`offload` names ``module`` (:mod:`lightning_seqpar.offload`), except ``shared`` ones (masks, rotary
        cos/sin: every layer's); with :attr:`recompute_norms`, ``rebuild``'s norm output is made again in backward
        instead of kept (:mod:`lightning_seqpar.memory.saved_tensors`). Inside full recomputation (which keeps nothing but the layer's
        input), or with neither, one that does nothing."""
        if self.checkpointed_whole or not torch.is_grad_enabled() or (module in _MLP_REGIONS and self.recompute_mlp):
            return contextlib.nullcontext()  # (hooks inside a checkpointed region would take its saved tensors)
        packer = self.offload.packer(self, module, shared) if self.offload is not None else None
        rebuild = rebuild if self.recompute_norms else None
        if packer is None and rebuild is None:
            return contextlib.nullcontext()
        return saved_tensor_policy(rebuild, packer)

    @property
    def mlp_slot(self) -> Optional[MLPSlot]:
        """What fills this layer's MLP slot (a dense MLP or a mixture of experts), asked through
        :class:`~lightning_seqpar.transformer.mlp_slot.MLPSlot`; ``None``: a layer without one the library built."""
        return None

    def layer_dims(self) -> LayerDims:
        """The single-device sizes and layout of this layer."""
        raise NotImplementedError(f"{type(self).__name__} must implement layer_dims().")

    def not_compilable(self) -> str:
        """Why this layer cannot run its body compiled whole, and the fix; ``""`` when it can (then it honours
        :attr:`compile_config`: :mod:`~lightning_seqpar.transformer.compiling`)."""
        return f"({type(self).__name__}) does not run a compiled body: train with compile=False"

    def attach_pipeline_stage(self, stage: int, router: LayerRouter) -> None:
        """Hold this layer on virtual pipeline stage ``stage``; every call then goes through ``router``.

        A router rather than a wrapper module keeps parameter names (state-dict keys) those of one device.
        """
        self.pipeline_stage, self._router = stage, router

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._routed(*args, **kwargs)
        return (out, None) if self.returns_tuple else out

    def _routed(self, *args: Any, **kwargs: Any) -> Any:
        if self._router is None:
            return super().__call__(*args, **kwargs)
        if not args:
            raise TypeError(
                f"{type(self).__name__} was called with keyword arguments only. Under pipeline parallelism a layer "
                f"takes the hidden state as its first positional argument (the stage hands it on)."
            )
        return self._router(super().__call__, *args, **kwargs)


class LayerStack(nn.Module):
    """Role: a rewritten module that runs its own list of :class:`ParallelLayer` in order.

    Subclasses implement :meth:`stack_layers` and run the layers with
    :func:`lightning_seqpar.transformer.stack.run_layers` (which honours :attr:`recompute_chunks`).

    Attributes:
        recompute_chunks: ``(start, end)`` layer ranges checkpointed as one unit (Megatron-LM's full
            recomputation, ``uniform``/``block``); set by :func:`~lightning_seqpar.recompute.apply_recompute`.
        stage_position: set when the stack is split into pipeline stages. A stack may skip work whose
            result only the first stage uses (an embedding) when ``stage_position.feeds_pipeline`` is
            ``False``: the running stage's first layer replaces its input by the received activation.
    """

    recompute_chunks: Sequence[tuple[int, int]] = ()
    stage_position: Optional[StagePosition] = None

    def stack_layers(self) -> nn.ModuleList:
        """The layers this module runs, in order (an ``nn.ModuleList`` the pipeline may split)."""
        raise NotImplementedError(f"{type(self).__name__} must implement stack_layers().")


def set_layer_memories(policies: Sequence[tuple[ParallelLayer, LayerMemory]]) -> None:
    """Give each layer its policy, all or none: every layer is checked (:meth:`ParallelLayer.memory_refusal`) before
    any is set, so a refusal leaves the model as it was.

    Raises:
        ValueError: the first refusal, naming the layer and the fix.
    """
    refusal = next((r for r in (layer.memory_refusal(m) for layer, m in policies) if r), "")
    if refusal:
        raise ValueError(refusal)
    for layer, memory in policies:
        layer.set_memory(memory)


def require_divisible(name: str, what: str, value: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``value`` is divisible by ``tp``."""
    if value % tp:
        raise ValueError(
            f"{name}: {what} = {value} is not divisible by the tensor-parallel size tp = {tp}. "
            f"Choose tp among the divisors of {value}, or change the model's {what}."
        )
