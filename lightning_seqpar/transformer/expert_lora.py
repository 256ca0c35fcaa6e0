"""LoRA on a mixture's packed experts (PEFT's ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``) rewritten with the experts they adapt: each expert's ``A`` and ``B`` follow the expert.

PEFT wraps the experts module once per targeted weight, nesting ``ParamWrapper`` layers (the outer one adapts the
parameter named last). :class:`ExpertLoRA` keeps that nesting around this rank's
:class:`~lightning_seqpar.moe.experts.GroupedExperts`, so names stay PEFT's
(``experts.base_layer.lora_A.default.weight``, ``experts.base_layer.base_layer.gate_up_proj``) in gradients,
checkpoints and exports, and hands its adapter to the experts, which compute it low-rank
(:mod:`lightning_seqpar.moe.expert_adapter`).

How the adapters split (the values are the one-device draw, sliced: training does not depend on the layout):

- over **ep** with their experts: ``A`` ``[r·E, in]`` by rows (expert-major), ``B`` ``[out, r·E]`` by columns within
  each of its r blocks of E (expert-minor); gradients averaged over expert data parallel, as the experts';
- over **expert_tp** as a column- or row-parallel LoRA splits (:mod:`.lora`): on ``gate_up_proj`` (outputs split)
  ``B``'s rows split like the weight's outputs (gate and up halves separately, or interleaved as gpt-oss stores them)
  and ``A`` is whole, its gradient summed over etp (each slice of the outputs gives part of it); on ``down_proj``
  (inputs split) ``A``'s columns split and ``B`` is whole, its gradient summed over etp (its input, ``x A_iᵀ``, is
  each slice's partial sum, added up by the combine).

What is refused, naming the module (:func:`expert_adapters`): another PEFT method or layer type on the experts, more
than one active adapter, merged or disabled adapters, LoRA biases, DoRA, and an adapter on anything but the two packed
projections (a bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.moe.expert_adapter import PROJECTIONS, ExpertAdapter
from lightning_seqpar.moe.experts import GroupedExperts
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.placement import ShardSpec, inner_spec, place
from lightning_seqpar.transformer.lora import AdapterWeight, ParallelLoRA
from lightning_seqpar.transformer.tuner_layers import is_peft_tuner_layer


@dataclass(frozen=True)
class ExpertLoRAParts:
    """One PEFT ``ParamWrapper`` on a packed expert weight, on one device: ``a`` ``[r·E, in]``, ``b`` ``[out, r·E]``."""

    parameter_name: str
    adapter_name: str
    a: nn.Parameter
    b: nn.Parameter
    rank: int
    scaling: float


def expert_adapters(found: Any, where: str) -> list[ExpertLoRAParts]:
    """The adapters PEFT nested around an experts module, outermost first (empty for plain experts).

    Raises:
        ValueError: naming ``where`` and the feature, for what the parallel experts do not compute (see the module
            docstring).
    """
    chain, module, seen = [], found, set()
    while is_peft_tuner_layer(module):
        kind = f"{type(module).__module__}.{type(module).__name__}"
        if not (type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft.tuners.lora")):
            raise ValueError(f"{where}: a PEFT {kind} layer on the experts; the experts train LoRA adapters on their "
                             f"packed weights only (LoraConfig(target_parameters=[...gate_up_proj, ...down_proj])).")
        active, name = list(module.active_adapters), module.parameter_name
        problems = []
        if len(active) != 1:
            problems.append(f"{len(active)} active adapters {active} (train one at a time: model.set_adapter(name))")
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            problems.append("its adapter is merged into the weights or disabled (unmerge_adapter / enable_adapters)")
        if name not in PROJECTIONS:
            problems.append(f"it adapts {name!r}; only the packed projections {list(PROJECTIONS)} take adapters")
        elif name in seen:
            problems.append(f"{name!r} carries two adapters")
        adapter = active[0] if active else ""
        if active and (module.lora_bias.get(adapter, False) or module.use_dora.get(adapter, False)):
            problems.append("LoRA biases or DoRA (lora_bias=True / use_dora=True)")
        if problems:
            raise ValueError(f"{where}: this LoRA adapter on the experts cannot be trained under the strategy: "
                             f"{'; '.join(problems)}.")
        seen.add(name)
        chain.append(ExpertLoRAParts(name, adapter, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                                     int(module.r[adapter]), float(module.scaling[adapter])))
        module = module.base_layer
    return chain


class ExpertLoRA(ParallelLoRA):
    """PEFT's ``ParamWrapper`` on one packed weight of this rank's experts (``base_layer``: the experts, or another
    :class:`ExpertLoRA` for the other weight); see the module docstring.

    Shapes: ``lora_A`` ``[r·E/e, in]`` (``in/etp`` on ``down_proj``), ``lora_B`` ``[out, r·E/e]`` (``out/etp`` on
    ``gate_up_proj``); ``forward`` as :meth:`GroupedExperts.forward`: rows ``[R, h]`` → ``[R, h]``.
    """

    def __init__(self, base_layer: nn.Module, parts: ExpertLoRAParts, a: nn.Parameter, b: nn.Parameter,
                 transposed: bool) -> None:
        super().__init__()
        self.base_layer, self.parameter_name, self.adapter_name = base_layer, parts.parameter_name, parts.adapter_name
        self.rank, self.scaling, self.adapter_enabled = parts.rank, parts.scaling, True
        self.transposed = transposed  # the experts' weights are [E, in, out]
        self.lora_A = nn.ModuleDict({parts.adapter_name: AdapterWeight(a)})
        self.lora_B = nn.ModuleDict({parts.adapter_name: AdapterWeight(b)})

    def adapter(self) -> ExpertAdapter:
        return ExpertAdapter(self.parameter_name, self.lora_A[self.adapter_name].weight,
                             self.lora_B[self.adapter_name].weight, self.rank, self.scaling)

    def delta_weight(self) -> Tensor:
        """``(α/r) · B_i A_i`` of this rank's experts, shaped like its shard of the weight (``[E/e, out, in]``, or
        ``[E/e, in, out]`` transposed): what merging adds to it (PEFT's ``ParamWrapper.get_delta_weight``)."""
        a, b = self.lora_A[self.adapter_name].weight, self.lora_B[self.adapter_name].weight
        experts = a.shape[0] // self.rank
        pattern = "o r e, e r i -> e i o" if self.transposed else "o r e, e r i -> e o i"
        return torch.einsum(pattern, b.reshape(b.shape[0], self.rank, experts),
                            a.reshape(experts, self.rank, a.shape[1])) * self.scaling

    def forward(self, rows: Tensor, tokens_per_expert: Sequence[int], counts: Optional[Tensor] = None,
                adapters: Sequence[ExpertAdapter] = ()) -> Tensor:
        mine = (self.adapter(),) if self.adapter_enabled else ()
        return self.base_layer(rows, tokens_per_expert, counts, (*adapters, *mine))


def experts_with_lora(local: GroupedExperts, found: Any, ep: ParallelGroup, etp: ParallelGroup,
                      where: str) -> nn.Module:
    """``local`` (this rank's experts) inside the adapters PEFT put around ``found`` (the user's experts), each sliced
    to this rank's experts and width; ``local`` itself where ``found`` has none.

    Raises:
        ValueError: from :func:`expert_adapters`.
    """
    module: nn.Module = local
    for parts in reversed(expert_adapters(found, where)):
        a, b = _split(parts, local, ep, etp)
        module = ExpertLoRA(module, parts, a, b, local.transposed)
    return module


def _split(parts: ExpertLoRAParts, local: GroupedExperts, ep: ParallelGroup,
           etp: ParallelGroup) -> tuple[nn.Parameter, nn.Parameter]:
    """This rank's ``A`` and ``B`` of ``parts``, placed (see the module docstring)."""
    rows = parts.rank * local.num_experts
    by_expert = {"a": ShardSpec(dim=0, full_size=rows, padded_size=rows),  # expert-major rows
                 "b": ShardSpec(dim=1, full_size=rows, padded_size=rows, chunks=parts.rank)}  # expert-minor columns
    width = inner_spec(getattr(local, parts.parameter_name))  # the weight's split over etp, if any
    inner: dict[str, Optional[ShardSpec]] = {"a": None, "b": None}
    partial = ""
    if width is not None and parts.parameter_name == "gate_up_proj":  # outputs split: B's rows, A whole
        inner["b"] = ShardSpec(dim=0, full_size=width.full_size, padded_size=width.padded_size, chunks=width.chunks)
        partial = "a"
    elif width is not None:  # down_proj, inputs split: A's columns, B whole
        inner["a"] = ShardSpec(dim=1, full_size=width.full_size, padded_size=width.padded_size)
        partial = "b"
    made = {}
    for which, full in (("a", parts.a), ("b", parts.b)):
        value = by_expert[which].shard(full.detach(), ep)
        if inner[which] is not None:
            value = inner[which].shard(value, etp)
        made[which] = param = nn.Parameter(value.clone(), requires_grad=full.requires_grad)
        place(param, shard=by_expert[which], shard_over="ep", replicated_over="edp", inner=inner[which],
              partial_over=("etp",) if which == partial else ())
    return made["a"], made["b"]
