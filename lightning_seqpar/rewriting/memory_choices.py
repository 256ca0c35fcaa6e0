"""What :func:`lightning_seqpar.explain` says of memory: the bytes each recomputation and offload choice leaves per
layer on one rank, for the model's own layer sizes at the explained layout (:mod:`lightning_seqpar.memory.choices`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.choices import ChoiceBytes, choice_bytes
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.materialize import Materializer, meta_copy
from lightning_seqpar.transformer.roles import ParallelLayer


def meta_rewrite(model: nn.Module, ctx: RewriteContext) -> tuple[nn.Module, RewriteContext]:
    """A copy of ``model`` on the meta device (``model`` untouched, nothing allocated) and ``ctx`` building on it:
    what the explained rewrite gives :func:`layer_memory` to read."""
    holder = nn.Module()
    holder.model = meta_copy(model)
    return holder, dataclasses.replace(ctx, materialize=Materializer(seed=0, device=torch.device("meta")))


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """The memory choices of one layer of the explained model (bytes per layer and micro-batch, one rank)."""

    shape: TransformerShape
    t: int
    sequence_parallel: bool
    c: int
    rows: list[ChoiceBytes]
    note: str = ""

    def __str__(self) -> str:
        from lightning_seqpar.memory.choices import format_choices

        s = self.shape
        head = (f"Activations kept per layer and micro-batch (s={s.s}, b={s.b}, h={s.h}, a={s.a}, f={s.f}; one rank of "
                f"t={self.t}{' with SP' if self.sequence_parallel else ''}{f', c={self.c}' if self.c > 1 else ''}):")
        return "\n".join([head, format_choices(self.rows)] + ([f"  {self.note}"] if self.note else []))


def layer_memory(rewritten: nn.Module, ctx: RewriteContext, seq_len: int, micro_batch: int,
                 bytes_per_element: int) -> LayerMemory:
    """The memory choices of the first layer of ``rewritten`` (a copy of the explained model rewritten as ``ctx``
    says, on the meta device: :func:`meta_rewrite`) for micro-batches of ``micro_batch`` sequences of
    ``seq_len`` tokens."""
    layers = [m for m in rewritten.modules() if isinstance(m, ParallelLayer)]
    dims = layers[0].layer_dims()
    shape = TransformerShape(s=seq_len, b=micro_batch, h=dims.hidden_size, a=dims.num_heads, L=len(layers),
                             ffn_hidden_size=dims.ffn_hidden_size, num_kv_heads=dims.num_kv_heads,
                             gated_mlp=dims.gated_mlp)
    c = ctx.context.group.size if ctx.context is not None else 1
    layer = layers[0]
    mlp = layer.mlp_slot
    priced = mlp is not None and not mlp.unpriced()
    experts = mlp.mixture_shape(bytes_per_element) if priced else None
    notes = [f"{len(layers)} layers; LayerNorm statistics in float32 (CUDA)."]
    # The terms are the paper's layer's (Table 2, to the byte on the reference GPT): say where this one departs.
    departs = [what for what, yes in (
        ("grouped-query attention (fewer key/value heads: Q, K, V are overstated)",
         (dims.num_kv_heads or dims.num_heads) != dims.num_heads),
        ("a gated MLP (three [s, b, f/t] inner tensors where the table counts two)", dims.gated_mlp),
        ("fused core attention (no s² tensor kept: the rows without its recomputation overstate it)",
         getattr(layer, "fused_attention", False)),
        ("no dropout (the table counts the paper's 1-byte masks of the two residual dropouts)",
         getattr(getattr(layer, "attention_residual_dropout", None), "p", 0.1) == 0),
        ("a mixture of experts priced with balanced routing (a step's expert rows vary with the router) and the "
         "softmax top-k router's tensors", experts is not None),
        ("an MLP the table does not price (a shared expert, or layers unlike the first)",
         not priced or len({None if x.mlp_slot is None else x.mlp_slot.mixture_shape(bytes_per_element)
                            for x in layers}) > 1)) if yes]
    if departs:
        notes.append("This layer has " + "; ".join(departs) + ". The planner measures the model's own layer "
                     "(python -m lightning_seqpar.plan MODEL --memory-choices).")
    return LayerMemory(shape, dims.tp, dims.sequence_parallel, c,
                       choice_bytes(shape, dims.tp, dims.sequence_parallel, bytes_per_element, c,
                                    norm_statistics_bytes=4, experts=experts), " ".join(notes))
