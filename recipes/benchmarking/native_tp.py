"""The reference GPT block parallelized with torch's own TP + SP (``parallelize_module``), as
Lightning's ``ModelParallelStrategy`` users write it: the alternative our layers are measured against."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class NativeAttention(nn.Module):
    """Separate Q/K/V projections (a fused QKV weight cannot be column-split by ``ColwiseParallel``)."""

    def __init__(self, h: int, a: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = h // a
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h) for _ in range(4))
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape  # [b, s, h] replicated
        # -1: the a/t local heads after ColwiseParallel
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [b, a/t, s, s]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(F.softmax(scores.masked_fill(future, float("-inf")), dim=-1), self.dropout, self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)  # [b, s, h/t]
        return self.wo(y)


class NativeBlock(nn.Module):
    """Pre-LN block, batch-first ``[b, s, h]`` (torch-native SP shards dim 1, the sequence)."""

    def __init__(self, h: int, a: int, ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = NativeAttention(h, a, dropout)
        self.mlp = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


def parallelize_native(block: NativeBlock, mesh: DeviceMesh, sequence_parallel: bool = True) -> NativeBlock:
    """torchtitan's TP + SP plan for one block. Input and output: local ``[b, s/t, h]`` (SP) or ``[b, s, h]``."""
    if sequence_parallel:
        gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan = {
            "ln_1": SequenceParallel(use_local_output=True),
            "attn": PrepareModuleInput(**gather),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(use_local_output=True),
            "mlp": PrepareModuleInput(**gather),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)
