"""Dispatch with an expert capacity: each expert takes at most ``C`` of a rank's (token, expert) pairs, the rest are
dropped, and every buffer has a fixed size, so a layer call reads nothing on the host.

Megatron-Core's ``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity`` (GShard, Lepikhin et al.
2020; Switch Transformer, Fedus et al. 2021 §2.2), written anew. For ``n`` local tokens routed to ``k`` of ``E``
experts each:

1. the capacity is ``C = ⌈capacity_factor · n·k / E⌉`` pairs per expert and source rank (a host integer: ``n`` is a
   shape);
2. each expert keeps its ``C`` pairs of highest router score (``drop_policy="probs"``, Megatron's default) or its first
   ``C`` in token order (``"position"``); ties go to the earlier pair, so the drops are a pure function of the scores
   and the expert ids (deterministic, the same on every run and every device);
3. kept pairs are written to slot ``expert·C + rank`` of an ``[E·C, h]`` buffer (empty slots stay zero), which one
   all-to-all with equal splits (``E/e · C`` rows per rank) sends to the experts' ranks; each local expert computes its
   ``e·C`` rows, padding included;
4. the outputs return by the reverse all-to-all; a dropped pair reads a zero row, so a token's output is the weighted
   sum of its kept experts (its scores are not renormalized, as Megatron).

Bytes each rank sends per all-to-all: ``(e − 1)/e · E·C · h`` elements, whatever the routing. Which pairs are dropped
depends on the tokens a rank holds (``s/(t·c)·b`` under sequence and context parallelism), so a capacity that drops
makes the step depend on the layout, as in Megatron; with no pair dropped the step equals the dropless one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.moe.dispatch import all_to_all_v, check_expert_split, pairs_per_expert
from lightning_seqpar.parallel.collectives import ParallelGroup

def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``C = ⌈capacity_factor · tokens·k / E⌉``: the pairs one expert takes from one rank (Megatron's
    ``get_capacity``)."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


@dataclass(frozen=True)
class CapacityRouting:
    """One layer call's routing, from :meth:`CapacityDispatcher.dispatch` to :meth:`CapacityDispatcher.combine`.

    Attributes:
        slot: each pair's row in the ``[E·C]`` buffer, token-major ``[n·k]``; ``E·C`` for a dropped pair.
        capacity: C.
        shape: ``(n, k)``.
        tokens_per_expert: rows each local expert computes, ``e·C`` (host integers).
        expert_counts: the same on the device, ``[E/e]``.
    """

    slot: Tensor
    capacity: int
    shape: tuple[int, int]
    tokens_per_expert: list[int]
    expert_counts: Tensor


class CapacityDispatcher:
    """Dispatch and combine with an expert capacity over an expert-parallel group (see the module docstring).

    Args:
        group: the expert-parallel group (size e).
        num_experts: E; each rank holds ``E/e``.
        config: the capacity factor and drop policy (``capacity_factor`` set).

    Raises:
        ValueError: ``E`` not divisible by ``e``; a config without a capacity factor.
    """

    reads_sizes_on_host = False
    """Every size is a host integer fixed by the shapes: no host read, and a block that compiles as one graph."""

    def __init__(self, group: ParallelGroup, num_experts: int, config: DispatchConfig) -> None:
        check_expert_split(num_experts, group.size)
        if config.capacity_factor is None:
            raise ValueError("CapacityDispatcher needs a capacity_factor (dropless: TokenDispatcher).")
        self.group, self.num_experts, self.config = group, num_experts, config
        self.num_local = num_experts // group.size

    def dispatch(self, tokens: Tensor, experts: Tensor, scores: Tensor) -> tuple[Tensor, CapacityRouting]:
        """The rows this rank's experts compute: ``[E/e · e·C, h]``, grouped by local expert (each expert's ``e·C``
        rows: ``C`` from each source rank, zeros where it sent fewer).

        Args:
            tokens: ``[n, h]``, this rank's tokens.
            experts: ``[n, k]`` int64, each token's experts (global ids).
            scores: ``[n, k]``, the router's weights (the ``"probs"`` policy ranks pairs by them).
        """
        n, k = experts.shape
        e, local, total = self.group.size, self.num_local, self.num_experts
        capacity = expert_capacity(n, k, total, self.config.capacity_factor)  # type: ignore[arg-type]
        flat = experts.reshape(-1)
        pairs = torch.arange(n * k, device=flat.device)
        within = pairs if self.config.drop_policy == "position" else torch.argsort(
            scores.detach().reshape(-1).float(), descending=True, stable=True)  # ties: the earlier pair first
        order = within[torch.argsort(flat[within], stable=True)]  # by expert, then by the policy's rank
        counts = pairs_per_expert(flat, total)
        by_expert = flat[order]
        rank = pairs - (torch.cumsum(counts, 0) - counts)[by_expert]  # position among the expert's pairs
        sorted_slot = torch.where(rank < capacity, by_expert * capacity + rank, total * capacity)
        slot = torch.empty_like(sorted_slot).scatter_(0, order, sorted_slot)  # token-major
        buffer = tokens.new_zeros(total * capacity + 1, tokens.shape[-1]).index_add(
            0, slot, tokens.index_select(0, pairs // k))[:-1]  # the last row gathers the dropped: discarded
        sizes = [local * capacity] * e
        arrived = all_to_all_v(buffer, self.group, sizes, sizes)  # [source e, E/e, C, h]
        rows = arrived.view(e, local, capacity, -1).transpose(0, 1).reshape(local * e * capacity, -1)
        per_expert = [e * capacity] * local
        routing = CapacityRouting(slot, capacity, (n, k), per_expert,
                                  torch.full((local,), e * capacity, dtype=torch.int64, device=flat.device))
        return rows, routing

    def combine(self, outputs: Tensor, routing: CapacityRouting, scores: Tensor) -> Tensor:
        """Each token's kept experts' outputs summed, weighted by ``scores`` ``[n, k]``: ``[n, h]``.

        Args:
            outputs: ``[E/e · e·C, h]``, the local experts' outputs in :meth:`dispatch`'s row order.
        """
        n, k = routing.shape
        e, local, capacity = self.group.size, self.num_local, routing.capacity
        back = outputs.view(local, e, capacity, -1).transpose(0, 1).reshape(e * local * capacity, -1)
        sizes = [local * capacity] * e
        returned = all_to_all_v(back, self.group, sizes, sizes)  # [E·C, h] in this rank's slot order
        padded = torch.cat([returned, returned.new_zeros(1, returned.shape[-1])])  # a dropped pair reads zeros
        pairs = padded.index_select(0, routing.slot)
        return (pairs.view(n, k, -1) * scores.unsqueeze(-1)).sum(1).to(pairs.dtype)
