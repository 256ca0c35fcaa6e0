"""This rank's experts: ``E/e`` gated MLPs held as packed 3-D weights, computed over rows grouped by expert.

The weights are laid out as transformers 5.x packs them (``gate_up_proj`` ``[E, 2f, h]``: gate rows then up rows;
``down_proj`` ``[E, h, f]``), split along dim 0 over the expert-parallel ranks, each rank holding ``[E/e, …]``
(placed ``shard_over="ep"``, replicated over expert data parallel ``edp``). The expert MLPs run one after another,
each on its contiguous rows (a grouped GEMM as a loop: ``torch._grouped_mm`` covers CUDA bfloat16 only, and the loop
gives the same values on every device).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.placement import ShardSpec, place


class GroupedExperts(nn.Module):
    """``E/e`` gated MLPs, ``down(act(gate(x)) · up(x))`` per expert.

    Args:
        num_experts: E, experts of the whole layer.
        hidden_size: h.
        intermediate_size: f, each expert's MLP width.
        expert_parallel: e, ranks the experts are split over (``E % e == 0``).
        activation: the gate's activation (SiLU: SwiGLU).
        dtype: the weights' dtype (default: torch's default dtype).

    Attributes:
        gate_up_proj: ``[E/e, 2f, h]``.
        down_proj: ``[E/e, h, f]``.

    Raises:
        ValueError: ``E`` not divisible by ``e``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, expert_parallel: int = 1,
                 activation: Callable[[Tensor], Tensor] = F.silu, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if num_experts % expert_parallel:
            raise ValueError(f"{num_experts} experts do not split over ep={expert_parallel} ranks: choose ep dividing "
                             f"the expert count.")
        local = num_experts // expert_parallel
        self.num_experts, self.activation = num_experts, activation
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, dtype=dtype))
        split = ShardSpec(dim=0, full_size=num_experts, padded_size=num_experts)
        for weight in (self.gate_up_proj, self.down_proj):
            place(weight, shard=split, shard_over="ep", replicated_over="edp")

    def forward(self, rows: Tensor, tokens_per_expert: Sequence[int]) -> Tensor:
        """``rows`` ``[R, h]`` grouped by local expert (``tokens_per_expert[i]`` rows for expert i, in order) →
        ``[R, h]``. An expert given no rows still takes part, so its weights get a zero gradient, not ``None``."""
        outputs = []
        for i, chunk in enumerate(rows.split(list(tokens_per_expert))):
            gate, up = F.linear(chunk, self.gate_up_proj[i]).chunk(2, dim=-1)
            outputs.append(F.linear(self.activation(gate) * up, self.down_proj[i]))
        return torch.cat(outputs) if outputs else rows
