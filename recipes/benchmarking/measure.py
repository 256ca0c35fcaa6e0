"""Activation bytes of the reference GPT's layers, measured on one rank and set against Table 2."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from lightning_seqpar.context_parallel import ContextParallel
from lightning_seqpar.memory.activations import (Recompute, TransformerShape, layer_activation_terms,
                                                 offloaded_activation_terms)
from lightning_seqpar.memory.mixture import MixtureShape
from lightning_seqpar.memory.tracker import LiveActivationTracker, StorageRecord
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.offload import HostPool, apply_offload
from lightning_seqpar.recompute import apply_recompute, apply_recompute_modules, rewritten_layers
from lightning_seqpar.policies import rewrite
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.residual import cast_residual_stream


def remainder_kind(record: StorageRecord) -> str:
    """What a storage outside the paper's count is (the paper ignores LayerNorm statistics, §4)."""
    if record.shape and record.shape[-1] == 1:
        return "norm statistics (mean, rstd)"
    if record.dtype == torch.uint8 and len(record.shape) == 1:
        return "RNG state snapshot"
    return "activation"


@dataclass
class LayerMeasurement:
    """One layer's live bytes after the forward pass on one tensor-parallel rank, against Table 2."""

    t: int
    sequence_parallel: bool
    recompute: Recompute
    measured_bytes: int
    model_terms: dict[str, float]
    records: list[StorageRecord]
    offloaded_bytes: float = 0.0
    """bytes the layers' offloaded modules copied to host memory in the measured forward, per layer"""
    model_offloaded: float = 0.0
    """the model's figure for it (:func:`~lightning_seqpar.memory.activations.offloaded_activation_terms`)"""

    @property
    def model_bytes(self) -> float:
        return sum(self.model_terms.values())

    @property
    def relative_error(self) -> float:
        return self.measured_bytes / self.model_bytes - 1

    def remainder(self) -> dict[str, int]:
        """Measured bytes the paper does not count, by kind (norm statistics, RNG snapshots)."""
        out: dict[str, int] = {}
        for r in self.records:
            kind = remainder_kind(r)
            if kind != "activation":
                out[kind] = out.get(kind, 0) + r.nbytes
        return out

    def breakdown(self) -> list[tuple[str, str, tuple[int, ...], str, int]]:
        """(module, op, shape, dtype, bytes) of every live storage the layer created."""
        return [(r.module, r.op, r.shape, str(r.dtype).replace("torch.", ""), r.nbytes) for r in self.records]


class _Root(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt


def measure_gpt_layer(
    shape: TransformerShape,
    group: ParallelGroup,
    sequence_parallel: bool,
    recompute: Recompute,
    dtype: torch.dtype = torch.bfloat16,
    dropout: float = 0.1,
    layers: int = 3,
    seed: int = 0,
    autocast: bool = False,
    context: Optional[ParallelGroup] = None,
    comm: str = "ring",
    modules: Sequence[str] = (),
    offload: Sequence[str] = (),
    norm_statistics_bytes: int = 0,
    experts: Optional[MixtureShape] = None,
    expert_group: Optional[ParallelGroup] = None,
) -> LayerMeasurement:
    """Build the reference GPT, rewrite it for ``group``, and measure a middle layer's activations.

    Collective when ``group.size > 1`` (call on every rank). The layer measured is ``h[layers // 2]``:
    its own output is the next layer's LayerNorm input, so the layer-by-layer accounting of Table 2
    holds exactly. 16-bit activations, 1-byte dropout masks, the explicit core attention.

    ``dtype``: the parameters' and activations' dtype; with ``autocast=True`` the parameters stay float32 and the
    passes run under CPU autocast to ``dtype`` (Lightning's ``bf16-mixed``) with the residual stream cast to it
    (:func:`~lightning_seqpar.transformer.residual.cast_residual_stream`). ``context``: a context-parallel group
    (collective over it too; ``comm`` its attention): the layer keeps the rank's ``s/c`` tokens, and attention
    probabilities are not dropped (context-parallel attention refuses it; the residual dropouts stay).
    ``modules``: recomputation by module (``"mlp"``) beside ``recompute``; ``offload``: modules whose saved tensors go
    to a host pool (the device bytes left and the bytes moved are both measured); ``norm_statistics_bytes``: count the
    LayerNorm statistics in the model (the element size they are saved in; 0: the paper's terms).
    ``experts``: a mixture of experts in every layer's MLP place (its E, k, f, ep and expert_tp; ``rows`` is measured:
    what the layer's experts received; ``capacity_factor`` the dispatch's), ``expert_group`` the group its experts are split over (expert parallel, or
    each expert's width when ``experts.expert_tp > 1``; collective over it).
    """
    torch.manual_seed(seed)
    mixture = dict(n_experts=experts.num_experts, experts_per_token=experts.top_k,
                   expert_ffn_hidden_size=experts.expert_ffn) if experts is not None else {}
    config = GPTConfig(vocab_size=256, block_size=shape.s, n_layer=layers, n_head=shape.a, n_embd=shape.h,
                       dropout=dropout, ffn_hidden_size=shape.ffn_hidden_size, **mixture)
    root = _Root(GPT(config))
    if context is not None:
        for block in root.gpt.transformer.h:
            block.attn.core_attention.dropout = 0.0
    tracker_rng = RNGTracker.for_tensor_parallel(seed, group.rank)
    cp = ContextParallel(context, comm) if context is not None else None
    width = experts is not None and experts.expert_tp > 1
    rewrite(root, RewriteContext(group, sequence_parallel, tracker_rng, loss_parallel=True, context=cp,
                                 expert_group=None if width else expert_group,
                                 expert_tp_group=expert_group if width else None,
                                 expert_dispatch_group=expert_group if width else None,
                                 dispatch=DispatchConfig(experts.capacity_factor if experts is not None else None)))
    model = root.gpt.to(torch.float32 if autocast else dtype).train()
    received: dict[int, int] = {}
    if experts is not None:  # the rows each layer's experts receive: what the model's R is
        for i, block in enumerate(root.gpt.transformer.h):
            block.mlp.experts.register_forward_pre_hook(
                lambda module, args, i=i: received.__setitem__(i, args[0].shape[0]))
    if autocast:
        cast_residual_stream(rewritten_layers(model))
    apply_recompute(model, recompute)
    if modules:
        apply_recompute_modules(model, [*modules, *(["core_attn"] if recompute == "selective" else []),
                                        *(["full"] if recompute == "full" else [])])
    pool = HostPool("cpu")
    if offload:
        apply_offload(model, offload, pool)
    idx = torch.randint(0, config.vocab_size, (shape.b, shape.s))
    with torch.autocast("cpu", dtype, enabled=autocast):
        model(idx, idx).backward()  # warm-up: one-time buffers (the causal mask) are not activations
        moved = pool.bytes_out
        with LiveActivationTracker(model) as tracker:
            loss = model(idx, idx)
        moved = pool.bytes_out - moved
    prefix = f"transformer.h.{layers // 2}"
    records = tracker.live(prefix)
    measured = sum(r.nbytes for r in records)
    del loss
    arguments = dict(t=group.size, sequence_parallel=sequence_parallel and group.size > 1, recompute=recompute,
                     bytes_per_element=torch.finfo(dtype).bits // 8, c=context.size if context is not None else 1,
                     modules=modules, offload=offload, norm_statistics_bytes=norm_statistics_bytes)
    mixtures = [dataclasses.replace(experts, rows=received[i]) for i in range(layers)] if experts is not None else [None]
    terms = layer_activation_terms(shape, **arguments, experts=mixtures[len(mixtures) // 2])
    model_moved = sum(sum(offloaded_activation_terms(shape, **arguments, experts=mixture).values())
                      for mixture in mixtures) / len(mixtures)
    return LayerMeasurement(group.size, sequence_parallel and group.size > 1, recompute, measured, terms, records,
                            moved / layers, model_moved)
