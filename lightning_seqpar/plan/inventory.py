"""Every parameter of a model and how the strategy splits it: the planner's exact count of model state.

The split is read, not re-derived: a copy of the model on the meta device (no memory, nothing downloaded) is rewritten
by the strategy's own rewrite at one virtual tensor-parallel rank, and each parameter's
:class:`~lightning_seqpar.parallel.placement.Placement` says how it is split:

- ``column``: split by a column-parallel projection (q/k/v, gate/up, fused or not; a LoRA ``lora_B`` on one), or a
  q/k norm over all heads: ``numel / t`` per rank;
- ``row``: split by a row-parallel projection (o, down; a LoRA ``lora_A`` on one): ``numel / t``;
- ``vocab``: the embedding and LM head (and its bias), rows padded to a multiple of t: ``ceil(v / t)·h`` per rank;
- ``replicated``: no split (norms, per-head norms, row-parallel biases, learned positions): whole on every rank;
- ``expert``: a mixture of experts' packed weights (and biases) ``[E, …]``, split over the expert-parallel ranks:
  ``numel / e`` per rank, whatever t is; ``expert_width``: one also split along each expert's width under expert
  tensor parallelism (gate/up, down and the gate/up bias; not the down projection's bias), ``numel / (e·etp)``. Their
  data replicas are the expert data-parallel group, ``edp = t·c·d / (e·etp)`` ranks, not the dense ``d·c``
  (:mod:`.state`).

Which pipeline stage holds what follows :class:`~lightning_seqpar.pipeline_parallel.layout.StageLayout` and the
strategy's pipeline placement (:func:`lightning_seqpar.policies.pipeline_placement`): layers by stage; the embedding (and
learned positions) on the first stage; the final norm and the head on the last; a tied embedding and head on both; any
other parameter on every stage.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, TypeVar

import torch.nn as nn

from lightning_seqpar.tensor_parallel.sharding import padded_size

Split = Literal["column", "row", "vocab", "replicated", "expert", "expert_width"]
Part = Literal["layer", "embedding", "head", "final", "other"]


@dataclass(frozen=True)
class ParameterEntry:
    """One parameter of the single-device model.

    Attributes:
        name: its state-dict key.
        shape: its single-device shape.
        split: how tensor parallelism splits it (see the module docstring).
        part: ``layer`` (with :attr:`layer` its index), ``embedding`` (first stage), ``head`` / ``final`` (last
            stage), ``other`` (every stage).
        layer: the decoder layer's index, for ``part == "layer"``.
        tied: the embedding and head share it (held by the first and the last stage).
        trainable: ``requires_grad``; a frozen parameter (LoRA's base) has no gradient and no optimizer state.
        deferred: its gradient is one a split backward (ZB-H1, ZB-V, DualPipeV) leaves to W: a trained weight of a
            column- or row-parallel linear or of the experts (:func:`~lightning_seqpar.tensor_parallel.split_backward.
            split_weight_gradients`); not a LoRA adapter's, nor a frozen one's.
    """

    name: str
    shape: tuple[int, ...]
    split: Split
    part: Part
    layer: Optional[int] = None
    tied: bool = False
    trainable: bool = True
    deferred: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def expert(self) -> bool:
        """Whether it is an expert's (split over ``ep``, its replicas the expert data-parallel group)."""
        return self.split in ("expert", "expert_width")

    def local_numel(self, t: int, ep: int = 1, expert_tp: int = 1) -> int:
        """Elements on one rank of ``t`` tensor-parallel, ``ep`` expert-parallel and ``expert_tp`` expert
        tensor-parallel ranks (every rank holds the same number: vocabulary padding rows are stored; an expert weight
        is split over ``ep``, and over ``expert_tp`` along its width)."""
        if self.split == "expert":
            return self.numel // ep
        if self.split == "expert_width":
            return self.numel // (ep * expert_tp)
        if self.split == "vocab":
            return padded_size(self.shape[0], t) // t * (self.numel // self.shape[0])
        if self.split in ("column", "row"):
            return self.numel // t
        return self.numel


@dataclass(frozen=True)
class ExpertShape:
    """The mixture of experts of each layer (the same in every layer the planner accepts).

    Attributes:
        num_experts: E, routed experts per layer.
        top_k: k, experts each token is routed to.
        expert_ffn: f_e, each expert's MLP width.
        shared_ffn: the width of the dense MLP every token also goes through (Qwen2-MoE, GLM-4.5); 0: none.
    """

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0


@dataclass(frozen=True)
class SplitProjection:
    """A projection of the sampled layer whose weight gradient a split backward defers to W (what W reads of it:
    :func:`~lightning_seqpar.plan.activations.weight_gradient_bytes`).

    Attributes:
        kind: ``"column"`` (its output split over tp) or ``"row"`` (its input split).
        group: ``"attention"`` or ``"mlp"``: the column-parallel projections of a group read one input.
        width: single-device width of its split side, the output (column) or the input (row).
        rank: r of the LoRA adapter trained on it (its base frozen); 0 where the weight itself is trained.
    """

    kind: str
    group: str
    width: int
    rank: int = 0


T = TypeVar("T")


@dataclass
class ModelInventory:
    """A model's parameters (:class:`ParameterEntry`) and the sizes the activation and FLOPs models read.

    Attributes:
        name: the model's class or preset name.
        entries: every unique parameter, in the model's order.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, ffn_hidden_size, vocab_size: L, h, a, g, d, f, v;
            under a mixture of experts ``f = k·f_e + f_shared``, the MLP width each token goes through (its FLOPs and
            the rows it keeps for backward).
        gated_mlp: three ``h × f`` matrices (SwiGLU) instead of two.
        attention_dropout: the attention-probability dropout (a mask is kept only when > 0).
        eager_attention: the explicit core attention (keeps ``a·s²`` probabilities unless recomputed) or a fused kernel.
    """

    name: str
    entries: list[ParameterEntry]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    gated_mlp: bool
    attention_dropout: float = 0.0
    eager_attention: bool = True
    config: Any = None
    """the Hugging Face config the model was built from (what the activation probes copy)"""
    experts: Optional[ExpertShape] = None
    """each layer's mixture of experts; ``None``: dense MLPs"""
    training: Any = None
    """which parameters are trained (:class:`~lightning_seqpar.plan.trained.TrainedParts`: LoRA, frozen names), as
    the activation probes copy it; ``None``: every parameter"""
    sample_layer: int = 0
    """the index of the layer the shapes are read from (the first mixture of experts where dense layers lead)"""
    split_projections: tuple[SplitProjection, ...] = ()
    """the sampled layer's dense projections whose weight gradient W computes (none where nothing is deferred)"""
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()``, once per ``key`` for this inventory: a figure read off its entries alone (a rank's model-state
        bytes, the parameters a pipeline rank holds), which thousands of layouts sharing their grid and rank ask for
        again (a 70B question priced the same rank's state 50 000 times, walking 723 entries each time). The
        result is shared between the callers: an immutable value or one nobody changes."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @functools.cached_property
    def probe_key(self) -> str:
        """What identifies the model to a cache of activation probes (its config, attention and which parameters are
        trained): two models never share a fit."""
        config = self.config
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
        trained = "" if self.training is None else f"|{self.training.key}"
        return hashlib.sha256(f"{self.name}|{self.eager_attention}|{text}{trained}".encode()).hexdigest()

    @property
    def num_trainable(self) -> int:
        """Single-device count of the parameters trained (``requires_grad``; LoRA's adapters, a partly frozen model's
        rest): those with gradients, main params and optimizer state."""
        return sum(e.numel for e in self.entries if e.trainable)

    @functools.cached_property
    def head_trained(self) -> bool:
        """Whether the LM head's weight is trained (its own, or the embedding tied to it): a frozen head (LoRA's)
        makes no weight gradient in backward."""
        return any(e.trainable for e in self.entries if e.part == "head" or e.tied)

    @functools.cached_property
    def frozen_gemm_elements(self) -> float:
        """Elements of the frozen weight matrices whose GEMMs run forward and backward but make no weight gradient
        (LoRA's base, a partly frozen model's rest): the layers', the head's and a tied embedding's (it is the head's
        weight), an expert's weighted by k/E (the tokens it sees). A step skips ``2 × tokens ×`` these FLOPs of
        Eq. 8's count; 0 when every weight is trained."""
        experts = self.experts
        return sum(e.numel * (experts.top_k / experts.num_experts if e.expert and experts is not None else 1.0)
                   for e in self.entries if not e.trainable and len(e.shape) >= 2
                   and (e.part in ("layer", "head") or (e.part == "embedding" and e.tied)))

    @functools.cached_property
    def weight_gradient_share(self) -> float:
        """W's share of a layer's weight-gradient FLOPs under a split backward (ZB-H1, ZB-V, DualPipeV): the deferred
        weights' elements over all the layer's matrices (each GEMM's FLOPs are its weight's elements × the tokens
        through it: an expert's weighted by k/E, the tokens it sees). 1 when every weight is trained; LoRA's
        adapters over their frozen bases, ``r·(in + out) / (in·out)`` each, near 0; 0 with nothing deferred."""
        def flops(e: ParameterEntry) -> float:
            experts = self.experts
            return e.numel * (experts.top_k / experts.num_experts if e.expert and experts is not None else 1.0)

        layer = [e for e in self.entries if e.part == "layer" and e.layer == self.sample_layer and len(e.shape) >= 2]
        total = sum(flops(e) for e in layer)
        return sum(flops(e) for e in layer if e.deferred) / total if total else 0.0

    @property
    def num_parameters(self) -> int:
        """Single-device parameter count (a tied weight once)."""
        return sum(e.numel for e in self.entries)

    @property
    def tied_embeddings(self) -> bool:
        return any(e.tied for e in self.entries)


def inventory_of_model(model: nn.Module, specs: dict[str, Any], placement: dict[str, str],
                       name: Optional[str] = None, consume: bool = False) -> ModelInventory:
    """Classify every parameter of ``model`` (built on the meta device; a Hugging Face causal LM).

    Args:
        model: the single-device model.
        specs: ``{decoder layer path: BlockSpec}`` of its transformer layers, in order.
        placement: ``{path: "first" | "last"}``, the parts outside the layers one pipeline stage holds, as the
            strategy places them (:func:`lightning_seqpar.policies.pipeline_placement`).
        consume: ``model`` is not used again, so a dense one is rewritten in place rather than copied first (a
            meta-device copy of a LoRA-wrapped 80-layer model costs as much as its rewrite).

    Raises:
        ValueError: no layer, or an embedding/head the vocabulary split does not recognize.
    """
    if not specs:
        raise ValueError(f"{type(model).__name__}: no transformer layer the rewrite recognizes; nothing to plan.")
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__}: the planner needs an nn.Embedding input and an nn.Linear LM head.")
    tied = head.weight is embedding.weight
    vocab = {id(p) for p in (*embedding.parameters(), *head.parameters())}
    layer_paths = list(specs)
    roles: dict[int, tuple[Part, Optional[int]]] = {}
    for index, path in enumerate(layer_paths):
        for param in model.get_submodule(path).parameters():
            roles[id(param)] = ("layer", index)
    for param in embedding.parameters():
        roles[id(param)] = ("embedding", None)
    for param in head.parameters():
        roles.setdefault(id(param), ("head", None))
    for path, where in placement.items():  # learned positions on the first stage, the final norm on the last
        for param in model.get_submodule(path).parameters():
            roles.setdefault(id(param), ("embedding" if where == "first" else "final", None))
    unique, seen = [], set()
    for pname, param in model.named_parameters():  # a tied weight once, under its first name
        if id(param) not in seen:
            seen.add(id(param))
            unique.append((pname, param))
    # The layer the shapes are read from: the first mixture of experts where dense and MoE layers mix (GLM-4.5's
    # first dense layers), as most layers are.
    mixtures = [p for p in layer_paths if not specs[p].projections()[1]]
    path = next(iter(mixtures), layer_paths[0])
    first = specs[path]
    inventory = _sizes(name or type(model).__name__, [], len(layer_paths), embedding, first,
                       model.get_submodule(path))
    shapes = [(pname, tuple(param.shape), roles.get(id(param), ("other", None)), id(param) in vocab,
               tied and param is embedding.weight, param.requires_grad) for pname, param in unique]
    # (read before the split: under `consume` the rewrite replaces these modules and parameters)
    splits, deferred = _splits(model, mixture=bool(mixtures), consume=consume)
    inventory.entries = [ParameterEntry(pname, shape, "vocab" if in_vocab else splits[pname], part, layer_index,
                                        tied=is_tied, trainable=trainable, deferred=pname in deferred)
                         for pname, shape, (part, layer_index), in_vocab, is_tied, trainable in shapes]
    inventory.sample_layer = layer_paths.index(path)
    inventory.split_projections = _split_projections(inventory.entries, path, first, inventory.hidden_size)
    return inventory


def _split_projections(entries: list[ParameterEntry], path: str, spec: Any, hidden: int) -> tuple[SplitProjection, ...]:
    """The dense projections of the layer at ``path`` (declared by ``spec``) with a deferred weight: the weight
    itself, or a LoRA adapter's ``lora_A``/``lora_B`` on it (PEFT's names, kept by the rewrite)."""
    mlp = spec.mlp if hasattr(spec.mlp, "mlp_out") else None  # a mixture's experts are priced by their own terms
    declared = [("column", "attention", p) for p in spec.attention.inputs()] + [
        ("row", "attention", spec.attention.attention_out)]
    if mlp is not None:
        declared += [("column", "mlp", p) for p in mlp.inputs()] + [("row", "mlp", mlp.mlp_out)]
    out = []
    for kind, group, projection in declared:
        own = [e for e in entries if e.name.startswith(f"{path}.{projection}.")]
        if not any(e.deferred for e in own):
            continue
        base = next(e for e in own if ".lora_" not in e.name and len(e.shape) == 2)
        adapter = next((e for e in own if ".lora_A." in e.name and e.deferred), None)
        out.append(SplitProjection(kind, group, base.numel // hidden, adapter.shape[0] if adapter else 0))
    return tuple(out)


def _splits(model: nn.Module, mixture: bool, consume: bool) -> tuple[dict[str, Split], set[str]]:
    """``{parameter name: "column" | "row" | "replicated" | ...}`` as the rewrite splits each parameter of ``model``
    (see the module docstring), read from the placements of a meta-device copy rewritten at one virtual rank; and the
    names of the parameters whose gradient a split backward defers to W (the same copy's layers, told to split).
    ``mixture``: some layer holds experts; ``consume``: ``model`` itself may be rewritten where no copy is needed."""
    import torch

    from lightning_seqpar.parallel.collectives import ParallelGroup
    from lightning_seqpar.parallel.placement import placement_of
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.tensor_parallel.layers import RowParallelLinear
    from lightning_seqpar.transformer.context import RewriteContext
    from lightning_seqpar.transformer.lora import LoRARowParallelLinear
    from lightning_seqpar.transformer.materialize import Materializer, meta_copy

    def rewritten(expert_tp: int, source: nn.Module) -> nn.Module:
        holder = nn.Module()
        holder.model = source
        width = ParallelGroup.virtual(expert_tp) if expert_tp > 1 else None
        ctx = RewriteContext(ParallelGroup.virtual(1), True, None, True, Materializer(seed=0, device=torch.device("meta")),
                             expert_tp_group=width, expert_dispatch_group=width)
        rewrite(holder, ctx, verify=False)
        return holder

    holder = None
    if mixture:  # at two expert tensor-parallel ranks, so the placements say which expert tensors split along the width
        try:
            holder = rewritten(2, meta_copy(model))
        except ValueError:  # an expert width that does not split (or no split at all): whole experts
            pass
    if holder is None:
        holder = rewritten(1, model if consume else meta_copy(model))
    rows = [name for name, m in holder.model.named_modules() if isinstance(m, (RowParallelLinear, LoRARowParallelLinear))]
    from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
    from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

    store = WeightGradientStore()
    split_weight_gradients(holder.model, store)
    deferred = {name for name, param in holder.model.named_parameters(remove_duplicate=False)
                if id(param) in store.deferred}
    out: dict[str, Split] = {}
    for name, param in holder.model.named_parameters(remove_duplicate=False):
        placement = placement_of(param)
        if placement.shard is None:
            out[name] = "replicated"
        elif placement.shard_over == "ep":
            out[name] = "expert_width" if placement.inner is not None else "expert"
        else:  # under a row-parallel projection (its weight, a LoRA lora_A on it), or a column-parallel one
            out[name] = "row" if any(name.startswith(row + ".") for row in rows) else "column"
    return out, deferred


def _sizes(name: str, entries: list[ParameterEntry], layers: int, embedding: nn.Embedding, spec: Any,
           sample: nn.Module) -> ModelInventory:
    from lightning_seqpar.transformer.block_spec import out_features, resolve, value_of

    hidden = embedding.weight.shape[1]
    heads = int(value_of(sample, spec.attention.num_heads))
    kv_heads = int(value_of(sample, spec.attention.num_kv_heads) or heads)
    head_dim = int(value_of(sample, spec.attention.head_dim) or hidden // heads)
    _, mlp = spec.projections()
    experts = None
    if not mlp:  # a mixture of experts
        experts = _expert_shape(name, sample, spec.mlp)
        ffn = experts.top_k * experts.expert_ffn + experts.shared_ffn
    else:
        ffn = out_features(resolve(sample, mlp[0])) // (2 if spec.mlp.gate_up else 1)
    declared = spec.attention
    dropout = value_of(sample, declared.attention_dropout) if isinstance(declared.attention_dropout, (int, float)) else 0.0
    attention = value_of(sample, declared.implementation) if "." in declared.implementation else declared.implementation
    return ModelInventory(name, entries, layers, hidden, heads, kv_heads, head_dim, ffn, embedding.weight.shape[0],
                          gated_mlp=experts is not None or len(mlp) == 2 or bool(spec.mlp.gate_up),
                          attention_dropout=float(dropout or 0.0), eager_attention=attention == "eager",
                          experts=experts)


def _expert_shape(name: str, sample: nn.Module, spec: Any) -> ExpertShape:
    """E, k, f_e and the shared MLP's width of a :class:`~lightning_seqpar.transformer.moe_part.MoESpec`'s block.

    Raises:
        ValueError: a router that does not say its ``top_k`` (the planner cannot count the rows per token).
    """
    from lightning_seqpar.transformer.block_spec import out_features, resolve

    down = resolve(sample, spec.experts).down_proj  # [E, h, f], or [E, f, h] transposed
    top_k = getattr(resolve(sample, spec.router), "top_k", None)
    if not isinstance(top_k, int):
        raise ValueError(f"{name}: the router at {spec.router} has no integer `top_k`; the planner cannot count the "
                         f"experts each token goes through. Choose the layout yourself (tp, pp, ep).")
    shared = 0
    if spec.shared is not None:
        first = spec.shared.inputs()[0]
        shared = out_features(resolve(sample, first)) // (2 if spec.shared.gate_up else 1)
    return ExpertShape(down.shape[0], top_k, down.shape[1] if spec.transposed else down.shape[2], shared)
