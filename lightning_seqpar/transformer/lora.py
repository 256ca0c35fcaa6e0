"""LoRA adapters (Hu et al., *LoRA*, 2021) on tensor- and sequence-parallel linears: Hugging Face PEFT's
``lora.Linear`` layers rewritten with the projection they wrap.

A LoRA linear computes ``y = x Wᵀ + b + (α/r) · drop(x) Aᵀ Bᵀ`` with ``A [r, in]`` and ``B [out, r]``. Split the way
its base is split, every rank computes its part with r-sized traffic only:

- **column-parallel base** (q/k/v, gate/up; fused or not): ``A`` replicated, ``B`` split like the base's output
  rows (``[out/t, r]``, fused blocks split per block). ``a = drop(x) Aᵀ`` is computed on the rank's own tokens
  (``[s/t, b, r]`` under SP) and then all-gathered (g; reduce-scattered in backward), so what LoRA-A keeps for
  backward is the sequence-local input, as the base keeps (Korthikanti et al. 2022 §4.2.2); without SP ``a`` goes
  through f (all-reduce of its gradient). Under SP each rank's ``A`` gradient covers its s/t tokens: tagged
  sequence-parallel, summed over tp.
- **row-parallel base** (o, down): ``A`` split like the base's input columns (``[r, in/t]``), ``B`` replicated.
  The adapter's partial product ``(α/r) · drop(x) Aᵀ Bᵀ`` is added to the base's before the one reduce-scatter
  (all-reduce without SP), as one process sums them; ``B``'s gradient is partial over tp (its input is a partial
  sum): tagged, summed over tp.

The values are the single-device adapter's, sliced (PEFT drew them on one device: training is the same at every
tp). Names stay PEFT's (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``,
``q_proj.lora_B.default.weight``), so gradients, checkpoints and exports are keyed as the PEFT model's.

Under a split backward (ZB-H1, ZB-V, DualPipeV) the adapter's two products split like the row-parallel product
(:func:`~lightning_seqpar.tensor_parallel.layers.split_product`): B computes their input gradients, W their weight
gradients (``weight_gradient_parameters``); the frozen base has no W.

LoRA dropout draws from the stream of the region its input lives in: the sequence-parallel stream for a
column-parallel input under SP (tokens differ per rank), the default generator for a replicated one, the
tensor-parallel stream for a row-parallel input (features differ per rank).

What is refused, naming the module (:func:`lora_parts`): DoRA, LoRA biases, more than one active adapter, merged or
disabled adapters, a base that is not an ``nn.Linear`` (GPT-2's ``Conv1D``), adapters on anything the strategy does
not rewrite as a block projection (:func:`refuse_unsupported_peft`), and PEFT methods other than LoRA.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch.nn as nn
from torch import Tensor

from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, split_product
from lightning_seqpar.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
)
from lightning_seqpar.tensor_parallel.sharding import shard_parameter
from lightning_seqpar.parallel.placement import set_sequence_parallel
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.tuner_layers import is_peft_tuner_layer


@dataclass(frozen=True)
class LoRAParts:
    """One active LoRA adapter of a PEFT ``lora.Linear``, on one device: ``a`` ``[r, in]``, ``b`` ``[out, r]``."""

    name: str
    a: nn.Parameter
    b: nn.Parameter
    scaling: float
    dropout: float


def lora_parts(module: Any, where: str) -> Optional[LoRAParts]:
    """The adapter of a PEFT ``lora.Linear`` (``None`` for any other module).

    Raises:
        ValueError: naming ``where`` and the feature, for what the parallel LoRA layers do not compute: another PEFT
            layer type, DoRA, LoRA biases, several or no active adapters, merged or disabled adapters, a base that is
            not an ``nn.Linear``.
    """
    if not is_peft_tuner_layer(module):
        return None
    kind = type(module).__name__
    if not (hasattr(module, "lora_A") and hasattr(module, "lora_B") and type(module).__module__.startswith(
            "peft.tuners.lora")):
        raise ValueError(f"{where}: a PEFT {type(module).__module__}.{kind} layer; only LoRA adapters are trained "
                         f"under the strategy. Use peft.LoraConfig.")
    base = module.get_base_layer()
    active = list(module.active_adapters)
    problems = []
    if type(base) is not nn.Linear:
        problems.append(f"its base is a {type(base).__name__}, not an nn.Linear (LoRA on GPT-2's Conv1D projections "
                        f"is not supported)")
    if len(active) != 1:
        problems.append(f"{len(active)} active adapters {active} (train one at a time: model.set_adapter(name))")
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        problems.append("its adapter is merged into the base or disabled (model.unmerge_adapter() / enable_adapters)")
    name = active[0] if active else ""
    if active and getattr(module, "use_dora", {}).get(name, False):
        problems.append("DoRA (use_dora=True)")
    if active and getattr(module, "lora_bias", {}).get(name, False):
        problems.append("LoRA biases (lora_bias=True)")
    if active and name not in module.lora_A:
        problems.append(f"the active adapter {name!r} is not a linear adapter here")
    if problems:
        raise ValueError(f"{where}: this LoRA layer cannot be trained under the strategy: {'; '.join(problems)}.")
    drop = module.lora_dropout[name]
    return LoRAParts(name, module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]),
                     float(drop.p) if isinstance(drop, nn.Dropout) else 0.0)


class AdapterWeight(nn.Module):
    """Holds one adapter matrix as ``weight``, so names stay PEFT's (``lora_A.default.weight``)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def _adapter_dicts(module: nn.Module, parts: LoRAParts, a: nn.Parameter, b: nn.Parameter) -> None:
    module.lora_A = nn.ModuleDict({parts.name: AdapterWeight(a)})
    module.lora_B = nn.ModuleDict({parts.name: AdapterWeight(b)})


class ParallelLoRA(nn.Module):
    """What every rewritten LoRA layer shares (the parallel linears here, the experts' in :mod:`.expert_lora`): one
    adapter, switched off by :func:`adapters_disabled` (``adapter_enabled``), and under a split backward its ``lora_A``
    and ``lora_B`` products deferring their weight gradients to W through :attr:`weight_gradients` (the base splits
    its own)."""

    weight_gradients: Optional[WeightGradientStore] = None
    """The B/W split's store (:func:`~lightning_seqpar.tensor_parallel.split_backward.split_weight_gradients`)."""

    def weight_gradient_parameters(self) -> list[nn.Parameter]:
        """``lora_A`` and ``lora_B``: the weights whose gradients W hands over under a split backward."""
        return [self.lora_A[self.adapter_name].weight, self.lora_B[self.adapter_name].weight]


class LoRAColumnParallelLinear(ParallelLoRA):
    """A :class:`ColumnParallelLinear` (``base_layer``) with a LoRA adapter; see the module docstring.

    Shapes: input ``[s/t, b, in]`` (SP) or ``[s, b, in]``; ``lora_A`` ``[r, in]`` replicated, ``lora_B``
    ``[out/t, r]``; output ``[s, b, out/t]``. :func:`column_parallel_linears` applies ``base_layer`` with the other
    projections of the same input (one all-gather) and adds :meth:`adapter`.
    """

    def __init__(self, base: ColumnParallelLinear, parts: LoRAParts, ctx: RewriteContext) -> None:
        super().__init__()
        self.base_layer, self.scaling = base, parts.scaling
        a = nn.Parameter(parts.a.detach().clone(), requires_grad=parts.a.requires_grad)
        if base.sequence_parallel and ctx.group.size > 1:  # each rank's gradient covers its s/t tokens
            set_sequence_parallel(a)
        b = shard_parameter(parts.b, base.spec, ctx.group)  # the base's output rows, block by block
        _adapter_dicts(self, parts, a, b)
        self.adapter_name, self.adapter_enabled = parts.name, True
        self.lora_dropout = ParallelDropout(parts.dropout, ctx.rng_tracker, sharded=base.sequence_parallel)

    @property
    def linear_weight(self) -> Tensor:
        return self.base_layer.linear_weight

    @property
    def bias(self) -> Optional[Tensor]:
        return self.base_layer.bias

    def adapter(self, x: Tensor) -> Tensor:
        """``(α/r) · g(drop(x) Aᵀ) Bᵀ`` ``[s, b, out/t]`` from the input as the base takes it (``[s/t, b, in]``
        under SP)."""
        base, store = self.base_layer, self.weight_gradients
        a = split_product(self.lora_dropout(x), self.lora_A[self.adapter_name].weight, store)  # [s/t, b, r]
        if base.sequence_parallel:
            a = gather_from_sequence_parallel_region(a, base.group)  # [s, b, r]; backward reduce-scatters
        else:
            a = copy_to_tensor_parallel_region(a, base.group)  # backward all-reduces: B is split by output
        return split_product(a, self.lora_B[self.adapter_name].weight, store) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        if not self.adapter_enabled:
            return self.base_layer(x)
        return self.base_layer(x) + self.adapter(x)


class LoRARowParallelLinear(ParallelLoRA):
    """A :class:`RowParallelLinear` (``base_layer``) with a LoRA adapter whose partial product joins the base's
    before the one reduction; see the module docstring.

    Shapes: input ``[s, b, in/t]``; ``lora_A`` ``[r, in/t]``, ``lora_B`` ``[out, r]`` replicated; output
    ``[s/t, b, out]`` (SP) or ``[s, b, out]``.
    """

    def __init__(self, base: RowParallelLinear, parts: LoRAParts, ctx: RewriteContext) -> None:
        super().__init__()
        self.base_layer, self.scaling, self.adapter_name = base, parts.scaling, parts.name
        self.adapter_enabled = True
        a = shard_parameter(parts.a, base.spec, ctx.group)  # the base's input columns
        b = nn.Parameter(parts.b.detach().clone(), requires_grad=parts.b.requires_grad)
        if ctx.group.size > 1:  # its input is this rank's partial sum: the gradient is partial too
            set_sequence_parallel(b)
        _adapter_dicts(self, parts, a, b)
        self.lora_dropout = ParallelDropout(parts.dropout, ctx.rng_tracker, sharded=ctx.group.size > 1)

    def forward(self, x: Tensor) -> Tensor:
        if not self.adapter_enabled:
            return self.base_layer(x)
        store = self.weight_gradients
        a = split_product(self.lora_dropout(x), self.lora_A[self.adapter_name].weight, store)  # [s, b, r], partial
        adapter = split_product(a, self.lora_B[self.adapter_name].weight, store) * self.scaling
        return self.base_layer.reduce(self.base_layer.partial(x) + adapter)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """``model`` computes its frozen base for the duration (DPO's reference model: no second copy): PEFT's own LoRA
    layers through ``PeftModel.disable_adapter()``, the rewritten parallel ones (:class:`ParallelLoRA`: the linears
    and the experts') by their ``adapter_enabled`` flag, which no other code sets. Adapter dropout does not run, so no
    random number is drawn."""
    ours = [m for m in model.modules() if isinstance(m, ParallelLoRA)]
    peft_layers = any(is_peft_tuner_layer(m) for m in model.modules())  # PEFT's disable_adapter refuses none left
    with model.disable_adapter() if peft_layers else nullcontext():
        for module in ours:
            module.adapter_enabled = False
        try:
            yield
        finally:
            for module in ours:
                module.adapter_enabled = True


def column_with_lora(base: ColumnParallelLinear, found: Any, ctx: RewriteContext, where: str) -> nn.Module:
    """``base`` with the adapter of ``found`` (a PEFT LoRA layer), or ``base`` when ``found`` has none."""
    parts = lora_parts(found, where)
    return base if parts is None else LoRAColumnParallelLinear(base, parts, ctx)


def row_with_lora(base: RowParallelLinear, found: Any, ctx: RewriteContext, where: str) -> nn.Module:
    """``base`` with the adapter of ``found`` (a PEFT LoRA layer), or ``base`` when ``found`` has none."""
    parts = lora_parts(found, where)
    return base if parts is None else LoRARowParallelLinear(base, parts, ctx)


def refuse_unsupported_peft(model: nn.Module, rewritten: list[str]) -> None:
    """Refuse PEFT parts the rewrite would drop or not split: a tuner layer outside the blocks being rewritten (an
    adapter on ``lm_head`` or ``embed_tokens``), ``modules_to_save`` copies, and PEFT methods other than LoRA.

    Raises:
        ValueError: naming the module and the fix.
    """
    for name, module in model.named_modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            for adapter, config in configs.items():
                kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))
                if kind != "LORA":
                    raise ValueError(f"{name or type(model).__name__}: PEFT adapter {adapter!r} is {kind}; only LoRA "
                                     f"is trained under the strategy. Use peft.LoraConfig.")
        inside = any(name == r or name.startswith(f"{r}.") for r in rewritten)
        if type(module).__name__ == "ModulesToSaveWrapper":
            raise ValueError(f"{name}: PEFT modules_to_save (a trainable copy of {name.rsplit('.', 1)[-1]}) is not "
                             f"supported under the strategy: remove it from the LoraConfig.")
        if is_peft_tuner_layer(module) and not inside:
            raise ValueError(f"{name}: a PEFT adapter outside the transformer layers the strategy rewrites; LoRA is "
                             f"trained on the layers' projections only (q/k/v/o, gate/up/down). Remove "
                             f"{name.rsplit('.', 1)[-1]!r} from target_modules.")


def lora_initializers(root: nn.Module) -> list[tuple[str, Any]]:
    """``(qualified name, initializer)`` for the adapters of every PEFT LoRA layer in ``root``, for a model built on
    the meta device: LoRA's own rule rather than the model's (which would draw B like any Linear, so the adapted
    model would not start as the pretrained one). ``init_lora_weights=True`` (PEFT's default): A
    ``kaiming_uniform_(a=√5)``, B zeros; ``"gaussian"``: A ``normal(0, 1/r)``, B zeros; ``False``: both as
    ``nn.Linear``'s own initializer.

    Raises (when an adapter is initialized):
        ValueError: another rule (PiSSA, OLoRA, LoftQ, EVA, ...: computed from the pretrained weights), naming it and
            the fix.
    """
    rules = {}
    for name, module in root.named_modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            for layer_name, layer in module.named_modules():
                for adapter in getattr(layer, "lora_A", {}) if is_peft_tuner_layer(layer) else ():
                    if adapter in configs:
                        prefix = f"{name}.{layer_name}" if name else layer_name
                        rules[prefix, adapter] = getattr(configs[adapter], "init_lora_weights", True)
    found = []
    for (prefix, adapter), rule in rules.items():
        for matrix in ("lora_A", "lora_B"):
            found.append((f"{prefix}.{matrix}.{adapter}",
                          lambda sub, name, rule=rule, matrix=matrix: _init_adapter(sub, name, rule, matrix)))
    return found


def _init_adapter(module: nn.Module, name: str, rule: Any, matrix: str) -> None:
    weight = getattr(module, "weight", None)
    if weight is None:
        return
    if rule is False:
        module.reset_parameters()
    elif rule is True or rule == "gaussian":
        if matrix == "lora_B":
            nn.init.zeros_(weight)
        elif rule is True:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            nn.init.normal_(weight, std=1 / weight.shape[0])
    else:
        raise ValueError(f"{name}: init_lora_weights={rule!r} computes the adapter from the pretrained weights, which "
                         f"a model built on the meta device does not hold when the adapter is initialized. Use "
                         f"init_lora_weights=True (or 'gaussian'), or start from a PEFT adapter directory made with it.")


def adapter_keys(root: nn.Module) -> set[str]:
    """State-dict keys of ``root`` that PEFT adapters added (``...lora_A.default.weight``): not in a base model's
    checkpoint, initialized by LoRA's rule (:func:`lora_initializers`) unless an adapter directory gives them."""
    keys = set()
    for name, module in root.named_modules():
        if is_peft_tuner_layer(module):
            for key in module.state_dict(keep_vars=True):
                if key.split(".")[0] in ("lora_A", "lora_B"):
                    keys.add(f"{name}.{key}" if name else key)
    return keys


def peft_key_mapping(model: nn.Module) -> Optional[dict[str, str]]:
    """For a PEFT-wrapped model, ``{the base model's key: the wrapped model's key}``
    (``model.layers.0.self_attn.q_proj.weight`` → ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``):
    how a base checkpoint's keys name the wrapped model's tensors. ``None`` for any other model."""
    if not isinstance(getattr(model, "peft_config", None), dict) or not callable(getattr(model, "get_base_model", None)):
        return None  # (PEFT also puts its config on the wrapped transformers model: that one is no wrapper)
    mapping = {}
    for key in model.state_dict(keep_vars=True):
        parts = key.split(".")
        if parts[:2] == ["base_model", "model"]:
            parts = parts[2:]
        if "lora_A" in parts or "lora_B" in parts:
            continue
        mapping[".".join(p for p in parts if p != "base_layer")] = key
    return mapping
