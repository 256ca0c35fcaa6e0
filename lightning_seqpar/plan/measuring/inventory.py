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
  tensor parallelism (gate/up, down and the gate/up bias; not the down projection's bias), ``numel / (e·etp)``. LoRA
  adapters on the packed weights follow their experts: ``A`` ``[r·E, in]`` and ``B`` ``[out, r·E]`` split over ep,
  ``B`` of gate/up and ``A`` of down along the width too (:mod:`lightning_seqpar.transformer.expert_lora`). Their
  data replicas are the expert data-parallel group, ``edp = t·c·d / (e·etp)`` ranks, not the dense ``d·c``
  (:mod:`..pricing.state`).

Which pipeline stage holds what follows :class:`~lightning_seqpar.pipeline_parallel.layout.StageLayout` and the
strategy's pipeline placement (:func:`lightning_seqpar.policies.pipeline_placement`): layers by stage; the embedding (and
learned positions) on the first stage; the final norm and the head on the last; a tied embedding and head on both; any
other parameter on every stage.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from lightning_seqpar.plan.pricing.model_inventory import (ExpertShape, ModelInventory, ParameterEntry, Part, Split,
                                                           SplitProjection)


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

    from lightning_seqpar.layout import Layout
    from lightning_seqpar.parallel.mesh import ParallelMesh
    from lightning_seqpar.parallel.placement import placement_of
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.tensor_parallel.layers import RowParallelLinear
    from lightning_seqpar.transformer.context import RewriteContext
    from lightning_seqpar.transformer.lora import LoRARowParallelLinear
    from lightning_seqpar.transformer.materialize import Materializer, meta_copy

    def rewritten(expert_tp: int, source: nn.Module) -> nn.Module:
        holder = nn.Module()
        holder.model = source
        layout = Layout(expert_tp=expert_tp)  # one dense rank, each expert's width over expert_tp
        mesh = ParallelMesh.virtual(layout.dims(expert_tp))
        ctx = RewriteContext.of(layout, mesh, materialize=Materializer(seed=0, device=torch.device("meta")))
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
    from lightning_seqpar.transformer.tuner_layers import linear_of

    down = linear_of(resolve(sample, spec.experts)).down_proj  # [E, h, f], or [E, f, h] transposed (inside PEFT's)
    top_k = getattr(resolve(sample, spec.router), "top_k", None)
    if not isinstance(top_k, int):
        raise ValueError(f"{name}: the router at {spec.router} has no integer `top_k`; the planner cannot count the "
                         f"experts each token goes through. Choose the layout yourself (tp, pp, ep).")
    shared = 0
    if spec.shared is not None:
        first = spec.shared.inputs()[0]
        shared = out_features(resolve(sample, first)) // (2 if spec.shared.gate_up else 1)
    return ExpertShape(down.shape[0], top_k, down.shape[1] if spec.transposed else down.shape[2], shared)
