"""Running a stack of layers with Megatron's full-recompute chunks."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.random import RNGTracker, recomputed


def run_layers(
    layers: Sequence[nn.Module],
    hidden: Tensor,
    recompute_chunks: Sequence[tuple[int, int]],
    rng_tracker: Optional[RNGTracker],
    **kwargs: Any,
) -> Tensor:
    """Apply ``layers`` in order; each ``(start, end)`` in ``recompute_chunks`` is checkpointed as one unit.

    A checkpointed chunk keeps only its input ``hidden`` for backward and recomputes its layers there
    (Megatron-LM ``--recompute-granularity full``). ``kwargs`` go to every layer's call, in backward's recomputation
    too (a context-parallel layout among them: the recomputed chunk attends as its forward did).
    """
    starts = dict(recompute_chunks) if torch.is_grad_enabled() else {}
    i = 0
    while i < len(layers):
        end = starts.get(i)
        if end is None:
            hidden = layers[i](hidden, **kwargs)
            i += 1
            continue

        def chunk(x: Tensor, lo: int = i, hi: int = end) -> Tensor:
            for layer in layers[lo:hi]:
                x = layer(x, **kwargs)
            return x

        hidden = recomputed(chunk, hidden, rng_tracker=rng_tracker)
        i = end
    return hidden
