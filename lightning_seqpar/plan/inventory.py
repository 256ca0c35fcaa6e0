"""Every parameter of a model and how the strategy splits it: the planner's exact count of model state.

The model is built on the meta device from its Hugging Face config (no memory, nothing downloaded), and each
parameter is classified the way the rewrite splits it, by the same declarations the rewrite uses
(:class:`~lightning_seqpar.transformer.block_spec.BlockSpec` of each decoder layer, read by the built-in
Hugging Face layouts):

- ``column``: a column-parallel projection's weight and bias (q/k/v, gate/up, fused or not), and a q/k norm over
  all heads: ``numel / t`` per rank;
- ``row``: a row-parallel projection's weight (o, down): ``numel / t``; its bias is replicated;
- ``vocab``: the embedding and LM head (and its bias), rows padded to a multiple of t: ``ceil(v / t)·h`` per rank;
- ``replicated``: norms, per-head norms, learned positions, everything else: whole on every rank.

Which pipeline stage holds what follows :class:`~lightning_seqpar.pipeline_parallel.layout.StageLayout` and the
strategy's pipeline placement (:func:`lightning_seqpar.policies.pipeline_placement`): layers by stage; the embedding (and learned positions) on the first stage; the final norm and the
head on the last; a tied embedding and head on both; any other parameter on every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch.nn as nn

from lightning_seqpar.tensor_parallel.sharding import padded_size

Split = Literal["column", "row", "vocab", "replicated"]
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
    """

    name: str
    shape: tuple[int, ...]
    split: Split
    part: Part
    layer: Optional[int] = None
    tied: bool = False
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def local_numel(self, t: int) -> int:
        """Elements on one tensor-parallel rank of ``t`` (every rank holds the same number: vocabulary padding rows
        are stored)."""
        if self.split == "vocab":
            return padded_size(self.shape[0], t) // t * (self.numel // self.shape[0])
        if self.split in ("column", "row"):
            return self.numel // t
        return self.numel


@dataclass
class ModelInventory:
    """A model's parameters (:class:`ParameterEntry`) and the sizes the activation and FLOPs models read.

    Attributes:
        name: the model's class or preset name.
        entries: every unique parameter, in the model's order.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, ffn_hidden_size, vocab_size: L, h, a, g, d, f, v.
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

    @property
    def num_parameters(self) -> int:
        """Single-device parameter count (a tied weight once)."""
        return sum(e.numel for e in self.entries)

    @property
    def tied_embeddings(self) -> bool:
        return any(e.tied for e in self.entries)


def inventory_of_model(model: nn.Module, specs: dict[str, Any], placement: dict[str, str],
                       name: Optional[str] = None) -> ModelInventory:
    """Classify every parameter of ``model`` (built on the meta device; a Hugging Face causal LM).

    Args:
        model: the single-device model.
        specs: ``{decoder layer path: BlockSpec}`` of its transformer layers, in order.
        placement: ``{path: "first" | "last"}``, the parts outside the layers one pipeline stage holds, as the
            strategy places them (:func:`lightning_seqpar.policies.pipeline_placement`).

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
    layer_paths = list(specs)
    roles: dict[int, tuple[Split, Part, Optional[int]]] = {}
    for index, path in enumerate(layer_paths):
        layer, spec = model.get_submodule(path), specs[path]
        attention, mlp = spec.projections()
        column = [*attention, *mlp]
        if spec.attention.qk_norm_over_heads:
            column += [p for p in (spec.attention.q_norm, spec.attention.k_norm) if p]
        row = [spec.attention.attention_out, spec.mlp.mlp_out]
        for pname, param in layer.named_parameters():
            roles[id(param)] = (_split(pname, column, row), "layer", index)
    for param in embedding.parameters():
        roles[id(param)] = ("vocab", "embedding", None)
    for param in head.parameters():
        if id(param) not in roles:
            roles[id(param)] = ("vocab", "head", None)
    for path, where in placement.items():  # learned positions on the first stage, the final norm on the last
        for param in model.get_submodule(path).parameters():
            roles.setdefault(id(param), ("replicated", "embedding" if where == "first" else "final", None))
    entries, seen = [], set()
    for pname, param in model.named_parameters():  # a tied weight once, under its first name
        if id(param) in seen:
            continue
        seen.add(id(param))
        split, part, layer_index = roles.get(id(param), ("replicated", "other", None))
        entries.append(ParameterEntry(pname, tuple(param.shape), split, part, layer_index,
                                      tied=tied and param is embedding.weight, trainable=param.requires_grad))
    first = specs[layer_paths[0]]
    sample = model.get_submodule(layer_paths[0])
    return _sizes(name or type(model).__name__, entries, len(layer_paths), embedding, first, sample)


def _split(pname: str, column: list[str], row: list[str]) -> Split:
    """How the rewrite splits the layer parameter ``pname``. A PEFT LoRA layer's base (``q_proj.base_layer.weight``)
    is split as the projection; its adapter follows it (:mod:`lightning_seqpar.transformer.lora`): on a
    column-parallel projection ``lora_A`` is replicated and ``lora_B`` split like the output, on a row-parallel one
    ``lora_A`` is split like the input and ``lora_B`` replicated."""
    owner, _, leaf = pname.rpartition(".")
    parts = owner.split(".")
    if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
        projection, matrix = ".".join(parts[:-2]), parts[-2]
        if projection in column:
            return "column" if matrix == "lora_B" else "replicated"
        if projection in row:
            return "row" if matrix == "lora_A" else "replicated"
        return "replicated"
    if parts[-1] == "base_layer":
        owner = ".".join(parts[:-1])
    if owner in column:
        return "column"
    if owner in row and leaf == "weight":
        return "row"
    return "replicated"


def _sizes(name: str, entries: list[ParameterEntry], layers: int, embedding: nn.Embedding, spec: Any,
           sample: nn.Module) -> ModelInventory:
    from lightning_seqpar.transformer.block_spec import out_features, resolve, value_of

    hidden = embedding.weight.shape[1]
    heads = int(value_of(sample, spec.attention.num_heads))
    kv_heads = int(value_of(sample, spec.attention.num_kv_heads) or heads)
    head_dim = int(value_of(sample, spec.attention.head_dim) or hidden // heads)
    _, mlp = spec.projections()
    ffn = out_features(resolve(sample, mlp[0])) // (2 if spec.mlp.gate_up else 1)
    declared = spec.attention
    dropout = value_of(sample, declared.attention_dropout) if isinstance(declared.attention_dropout, (int, float)) else 0.0
    attention = value_of(sample, declared.implementation) if "." in declared.implementation else declared.implementation
    return ModelInventory(name, entries, layers, hidden, heads, kv_heads, head_dim, ffn, embedding.weight.shape[0],
                          gated_mlp=len(mlp) == 2 or bool(spec.mlp.gate_up), attention_dropout=float(dropout or 0.0),
                          eager_attention=attention == "eager")
