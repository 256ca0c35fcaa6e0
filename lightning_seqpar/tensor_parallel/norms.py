"""A norm over features split across the tensor-parallel group (OLMo 2's q/k norms over all heads).

Each rank holds ``n/t`` of the ``n`` features and the matching slice of the weight; the mean of squares is the sum of
every rank's squares (one all-reduce of ``[..., 1]``) over ``n``, so every rank normalizes by the statistic of the
whole vector, as one device does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import sum_over_tensor_parallel_region
from lightning_seqpar.tensor_parallel.sharding import ShardSpec, shard_parameter


class TensorParallelRMSNorm(nn.Module):
    """RMSNorm over ``n`` features of which this rank holds ``n/t`` (T5/OLMo 2's form:
    ``(w · x / √(mean(x²) + ε)).to(dtype)``, the statistic in float32).

    Args:
        norm: the single-device norm (``weight [n]`` and ``variance_epsilon`` or ``eps``); its weight is sliced.
        group: the tensor-parallel group.

    Shapes: input ``[..., n/t]`` (a column-parallel projection's output); output the same; weight ``[n/t]``.
    """

    def __init__(self, norm: nn.Module, group: ParallelGroup) -> None:
        super().__init__()
        n = norm.weight.shape[0]
        self.group, self.features = group, n
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.weight = shard_parameter(norm.weight, ShardSpec(0, n, n), group)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        squares = sum_over_tensor_parallel_region(x.pow(2).sum(-1, keepdim=True), self.group)
        x = x * torch.rsqrt(squares / self.features + self.eps)
        return (self.weight * x).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.features} features (local {self.weight.shape[0]}), eps={self.eps}, tp={self.group.size}"
