"""This cp rank's share of a batch, for a model whose forward is the user's own (declared blocks).

A Hugging Face causal LM and the reference GPT take their tokens themselves (:mod:`lightning_seqpar.hf.context_parallel`,
:class:`~lightning_seqpar.models.parallel_gpt.ParallelGPT`); a model of declared blocks embeds and computes its loss in
code the library does not own, so its step asks for the rank's share explicitly, as Megatron-LM's training loop asks
``get_batch_on_this_cp_rank``, and its forward passes the share's layout on to its blocks, as Megatron-LM passes
``packed_seq_params`` through its model's forward::

    def forward(self, idx, positions, **layer_arguments):
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x, **layer_arguments)                         # the layout of this forward, as data
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        part = context_parallel_batch(self, x, labels=y)
        logits = self(part.input_ids, part.position_ids, **part.layer_arguments)
        summed = F.cross_entropy(logits.flatten(0, 1), part.labels.flatten(), reduction="sum")
        return part.loss(summed)                                    # the one-process mean, on every cp rank

The same code runs unparallelized: without context parallelism the share is the whole batch and
``layer_arguments`` is empty, so the user's own blocks are called as they always were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.context_parallel.layout import (
    LAYOUT_ARGUMENT, ContextParallelBatch, check_context_length, documents_from_positions, local_indices,
)
from lightning_seqpar.context_parallel.loss import sum_over_context
from lightning_seqpar.context_parallel.runtime import ContextParallel


@dataclass
class RankBatch:
    """This rank's tokens of a batch ``[b, s]``: ``[b, s/c]`` each, chunks ``r`` and ``2c−1−r``.

    Attributes:
        input_ids: the tokens.
        position_ids: their positions in the whole sequence (given ones kept: packed documents).
        labels: the targets at the same positions (aligned with ``input_ids``, as given), or ``None``.
        count: the whole batch's number of targets that are not ``ignore_index`` (at least 1).
        context: the cp group's runtime (``None`` without context parallelism).
        layout: this forward's :class:`~.layout.ContextParallelBatch` (``None`` without context parallelism).
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Optional[Tensor]
    count: Tensor
    context: Optional[ContextParallel]
    layout: Optional[ContextParallelBatch] = None

    @property
    def layer_arguments(self) -> dict[str, Any]:
        """The keyword arguments the model's forward passes on to each parallel block: the layout under
        :data:`~.layout.LAYOUT_ARGUMENT`, or none without context parallelism."""
        return {} if self.layout is None else {LAYOUT_ARGUMENT: self.layout}

    def loss(self, summed: Tensor) -> Tensor:
        """The mean over the whole batch's targets from this rank's ``summed`` loss (a sum over its targets),
        summed over the cp ranks: every rank returns the one-process value (token-weighted, however ignored
        targets fall across ranks)."""
        value = summed / self.count.to(summed.device)
        return value if self.context is None else sum_over_context(value, self.context.group)


def _context_of(model: nn.Module) -> Optional[ContextParallel]:
    for module in model.modules():
        context = getattr(module, "context", None)
        if isinstance(context, ContextParallel):
            return context
    return None


def context_parallel_batch(model: nn.Module, input_ids: Tensor, labels: Optional[Tensor] = None,
                           position_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                           ignore_index: int = -100) -> RankBatch:
    """This cp rank's share of the batch, with the layout its forward passes to ``model``'s parallel layers (see the
    module docstring).

    Args:
        model: the module whose forward calls the rewritten layers (the LightningModule will do).
        input_ids: ``[b, s]`` tokens of the whole sequence (every cp rank holds the batch).
        labels: ``[b, s]`` targets aligned with ``input_ids``, or ``None``.
        position_ids: ``[b, s]`` (restarting at 0 where a packed document starts), default ``0..s−1``.
        attention_mask: ``[b, s]``, 0 = padding (keys never attended).
        ignore_index: the target value the loss ignores.

    Raises:
        ValueError: ``s`` not divisible by ``2·c·t`` (under sequence parallelism) or ``2·c``.
    """
    context = _context_of(model)
    b, s = input_ids.shape
    positions = position_ids if position_ids is not None else torch.arange(s, device=input_ids.device).expand(b, s)
    count = ((labels != ignore_index).sum() if labels is not None else torch.tensor(b * s)).clamp(min=1)
    if context is None or context.c == 1:
        return RankBatch(input_ids, positions, labels, count, None)
    tp_unit = next((m.group.size for m in model.modules() if getattr(m, "context", None) is context and
                    getattr(m, "sp", False)), 1)
    check_context_length(s, context.c, tp_unit, type(model).__name__)
    mine = local_indices(s, context.c, context.group.rank, input_ids.device)
    documents = documents_from_positions(position_ids) if position_ids is not None else None
    padding = attention_mask == 0 if attention_mask is not None else None
    return RankBatch(input_ids[:, mine], positions[:, mine], None if labels is None else labels[:, mine], count,
                     context, ContextParallelBatch(context.group, context.comm, s, documents, padding))
