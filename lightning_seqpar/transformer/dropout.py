"""Dropout that draws from the right random stream for its region."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.random import RNGTracker, maybe_fork


def dropout(x: Tensor, p: float) -> Tensor:
    """Training-mode dropout that keeps a 1-byte boolean mask for backward on every device.

    ``F.dropout`` on CPU keeps a mask in the activation's dtype; the paper's accounting (and CUDA's
    fused kernel) keep one byte per element (Korthikanti et al. 2022 §4.1).
    """
    return torch.native_dropout(x, p, True)[0]


class ParallelDropout(nn.Module):
    """``nn.Dropout`` whose mask comes from the tensor-parallel stream when its input is sharded.

    Args:
        p: drop probability.
        rng_tracker: tracker holding the tensor-parallel stream.
        sharded: the input differs across tensor-parallel ranks (sequence-sharded under SP, or
            head/feature-sharded): ranks must draw different masks. When ``False`` the input is
            replicated and the default generator (identical on the group) keeps the copies equal.

    Shapes: any; output has the input's shape.
    """

    def __init__(self, p: float, rng_tracker: Optional[RNGTracker], sharded: bool) -> None:
        super().__init__()
        self.p, self.rng_tracker, self.sharded = p, rng_tracker, sharded

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        with maybe_fork(self.rng_tracker, self.sharded):
            return dropout(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, sharded={self.sharded}"
