"""Norms of query/key heads when the heads are split across the tensor-parallel group.

- :class:`TensorParallelRMSNorm`: one norm over all heads' features (OLMo 2's q/k norms). Each rank holds ``n/t`` of
  the ``n`` features and the matching slice of the weight; the mean of squares is the sum of every rank's squares (one
  all-reduce of ``[..., 1]``) over ``n``, so every rank normalizes by the statistic of the whole vector, as one
  device does.
- :class:`LocalHeadsNorm`: a norm over each head with a weight of its own per head (Cohere's ``use_qk_norm``, a
  ``[a, d]`` weight; StableLM's ``qk_layernorm``, one ``nn.LayerNorm`` per head). Each rank applies the weights of its
  ``a/t`` heads; the weights stay whole and replicated (under their single-device names), and since each head's weight
  gets its gradient on the one rank holding that head (zeros elsewhere), the gradients are summed over the group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import sum_over_tensor_parallel_region
from lightning_seqpar.tensor_parallel.sharding import shard_parameter
from lightning_seqpar.parallel.placement import ShardSpec


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


def per_head_weights(norm: nn.Module, heads: int) -> bool:
    """Whether ``norm`` has a weight of its own for each of ``heads`` heads: a ``[heads, d]`` weight, or a
    ``ModuleList`` ``norms`` of ``heads`` ``nn.LayerNorm``."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == heads:
        return True
    norms = getattr(norm, "norms", None)
    return isinstance(norms, nn.ModuleList) and len(norms) == heads and all(isinstance(n, nn.LayerNorm) for n in norms)


class LocalHeadsNorm:
    """A per-head norm whose weights differ per head, applied to this rank's heads ``[first, first + count)`` (see the
    module docstring). Not a module: the user's norm stays registered under its own name and keeps its whole weights.

    Args:
        norm: a norm with a ``[a, d]`` weight (called as it is, its weight and bias sliced to this rank's heads), or
            with ``norms``, one ``nn.LayerNorm(d)`` per head (their weights stacked, then sliced).
        first, count: this rank's heads.

    Shapes: input ``[..., a/t, d]`` (heads in the second-to-last dim); output the same.

    Raises:
        ValueError: ``norm`` has no weight per head (:func:`per_head_weights`).
    """

    def __init__(self, norm: nn.Module, first: int, count: int) -> None:
        self.norm, self.heads = norm, slice(first, first + count)
        self.stacked = isinstance(getattr(norm, "norms", None), nn.ModuleList)
        if not self.stacked and getattr(norm, "weight", None) is None:
            raise ValueError(f"{type(norm).__name__} has no weight per head (neither a [heads, d] weight nor norms).")

    def __call__(self, x: Tensor) -> Tensor:
        if not self.stacked:
            local = {name: p[self.heads] for name, p in self.norm.named_parameters(recurse=False)
                     if p.dim() == 2}
            return functional_call(self.norm, local, (x,), strict=False)
        norms = list(self.norm.norms)
        # Every head's weight enters the graph (the others' gradient is zero here), so every rank has a gradient for
        # every weight and the sum over the group has no missing terms.
        weight = torch.stack([n.weight for n in norms])[self.heads]
        bias: Optional[Tensor] = torch.stack([n.bias for n in norms])[self.heads] if norms[0].bias is not None else None
        shape, eps = norms[0].normalized_shape, norms[0].eps
        return torch.stack([F.layer_norm(x[..., i, :], shape, weight[i], None if bias is None else bias[i], eps)
                            for i in range(weight.shape[0])], dim=-2)
