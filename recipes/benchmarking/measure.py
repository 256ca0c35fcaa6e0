"""Activation bytes of the reference GPT's layers, measured on one rank and set against Table 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from lightning_seqpar.context_parallel import ContextParallel
from lightning_seqpar.memory.activations import Recompute, TransformerShape, layer_activation_terms
from lightning_seqpar.memory.tracker import LiveActivationTracker, StorageRecord
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.recompute import apply_recompute, rewritten_layers
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
    """
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=256, block_size=shape.s, n_layer=layers, n_head=shape.a, n_embd=shape.h,
                       dropout=dropout, ffn_hidden_size=shape.ffn_hidden_size)
    root = _Root(GPT(config))
    if context is not None:
        for block in root.gpt.transformer.h:
            block.attn.core_attention.dropout = 0.0
    tracker_rng = RNGTracker.for_tensor_parallel(seed, group.rank)
    cp = ContextParallel(context, comm) if context is not None else None
    rewrite(root, RewriteContext(group, sequence_parallel, tracker_rng, loss_parallel=True, context=cp))
    model = root.gpt.to(torch.float32 if autocast else dtype).train()
    if autocast:
        cast_residual_stream(rewritten_layers(model))
    apply_recompute(model, recompute)
    idx = torch.randint(0, config.vocab_size, (shape.b, shape.s))
    with torch.autocast("cpu", dtype, enabled=autocast):
        model(idx, idx).backward()  # warm-up: one-time buffers (the causal mask) are not activations
        with LiveActivationTracker(model) as tracker:
            loss = model(idx, idx)
    prefix = f"transformer.h.{layers // 2}"
    records = tracker.live(prefix)
    measured = sum(r.nbytes for r in records)
    del loss
    terms = layer_activation_terms(shape, group.size, sequence_parallel and group.size > 1, recompute,
                                   bytes_per_element=torch.finfo(dtype).bits // 8,
                                   c=context.size if context is not None else 1)
    return LayerMeasurement(group.size, sequence_parallel and group.size > 1, recompute, measured, terms, records)
