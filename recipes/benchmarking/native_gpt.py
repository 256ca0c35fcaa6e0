"""The reference GPT written for torch's own tensor parallelism (separate q/k/v projections, batch-first) and its
torch-native TP + SP plan over the whole model (torchtitan's: vocabulary-parallel embedding, sequence-parallel
norms, column-parallel head): the baseline the training benchmark runs beside our layouts, on the same sizes."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from recipes.benchmarking.native_tp import NativeBlock, parallelize_native


class NativeGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` :class:`NativeBlock` s, final norm, head: the reference GPT's
    parameters (q/k/v as three matrices instead of one fused one). ``idx``, ``targets``: token ids ``[b, s]`` →
    the mean cross entropy (a 0-dim float32 tensor). Parallelized, the blocks see local ``[b, s/t, h]``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(NativeBlock(n_embd, n_head, 4 * n_embd, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.tp_rank, self.tp = 0, 1

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        s = idx.shape[1]
        x = self.wte(idx)  # local [b, s/t, h] once parallelized (output sharded along the sequence)
        local = x.shape[1]
        positions = torch.arange(self.tp_rank * local, self.tp_rank * local + local, device=idx.device) if local < s \
            else torch.arange(s, device=idx.device)
        x = x + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, v] replicated (the head gathers the sequence)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize_native_gpt(model: NativeGPT, tp_mesh: DeviceMesh) -> NativeGPT:
    """torch-native TP + SP over ``tp_mesh``. The position embedding stays a plain replicated parameter whose
    gradient each rank computes for its sequence positions only: :func:`sum_position_gradient` sums it."""
    model.tp_rank, model.tp = tp_mesh.get_local_rank(), tp_mesh.size()
    for block in model.h:
        parallelize_native(block, tp_mesh)
    return parallelize_module(model, tp_mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })


def sum_position_gradient(model: NativeGPT, tp_mesh: DeviceMesh) -> None:
    """All-reduce the replicated position embedding's gradient over the tensor-parallel group."""
    grad = model.wpe.weight.grad
    if grad is not None and model.tp > 1:
        torch.distributed.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad,
                                     group=tp_mesh.get_group())
