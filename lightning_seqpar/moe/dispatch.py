"""Token dispatch and combine for expert parallelism: each (token, expert) pair travels to the rank holding the
expert and back, by two all-to-alls over the expert-parallel group.

Rank ``j`` of ``e`` expert-parallel ranks holds experts ``j·E/e … (j+1)·E/e − 1`` (the expert weights ``[E, …]``
split along dim 0, :class:`~lightning_seqpar.parallel.placement.Placement` ``shard_over="ep"``). For ``n`` local
tokens routed to ``k`` experts each (Megatron-Core's ``MoEAlltoAllTokenDispatcher``, written anew):

1. the ``n·k`` pairs are sorted by expert (stable: a token's pairs keep their order), so each destination rank's rows
   are contiguous, and each expert's rows inside them;
2. the counts per (destination rank, local expert), ``[e, E/e]``, are exchanged by one small all-to-all, then read
   on the host once (``.tolist()``: the one host synchronisation of a MoE layer, which sizes NCCL's buffers);
3. the rows go out by an all-to-all with those split sizes (:meth:`ParallelGroup.all_to_all_v`), arriving grouped by
   source rank, then by local expert; a second stable sort groups them by local expert for the expert MLPs;
4. the expert outputs return by the reverse permutation and all-to-all, and each token's ``k`` outputs are summed,
   weighted by the router's scores.

Every permutation is an index gather (its backward a scatter-add), so gradients reach the tokens, the scores and
every expert, an expert that received no token included (its gradient is zeros, never ``None``). Bytes each rank
sends per all-to-all: the pairs routed to another rank's experts × ``h`` × the element size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup


def check_expert_split(num_experts: int, ep: int) -> None:
    """Raises ``ValueError`` when ``ep`` ranks cannot hold ``E/e`` experts each, naming the fix."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over ep={ep} ranks: choose ep dividing the expert count.")


def check_width_split(intermediate_size: int, expert_tp: int) -> None:
    """Raises ``ValueError`` when ``expert_tp`` ranks cannot hold ``f/etp`` of each expert's width, naming the fix."""
    if intermediate_size % expert_tp:
        raise ValueError(f"An expert width of {intermediate_size} does not split over expert_tp={expert_tp} ranks: "
                         f"choose expert_tp dividing it.")


def expert_tensor_parallel_pairs(experts: Tensor, scores: Tensor, num_experts: int, ep: int, etp: int
                                 ) -> tuple[Tensor, Tensor]:
    """Each (token, expert) pair made ``etp`` pairs, one per slice of the expert's width: ``[n, k]`` global expert
    ids and scores → ``[n, k·etp]`` ids of the ``E·etp`` width slices and their scores (each slice's the expert's).

    A slice of expert ``x`` held by etp rank ``j`` of the ep rank ``x // (E/e)`` is numbered so that the
    :class:`TokenDispatcher` over the ``etp_ep`` group (``e·etp`` ranks, etp fastest) sends it to that rank as its
    local expert ``x mod E/e``: ``(j + etp·(x // (E/e)))·(E/e) + x mod E/e``. The slices' outputs, weighted by the same
    score, add up to the expert's output weighted by it (Megatron-Core's expert tensor parallelism, whose all-gather
    over etp after the all-to-all this is, in one all-to-all).
    """
    local = num_experts // ep
    owner, index = experts // local, experts % local
    slices = torch.arange(etp, device=experts.device)
    ids = ((slices + etp * owner.unsqueeze(-1)) * local + index.unsqueeze(-1)).flatten(1)  # [n, k·etp]
    return ids, scores.repeat_interleave(etp, dim=1)


def pairs_per_expert(experts: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64: how many of the (token, expert) pairs ``experts`` (global ids, any shape) go to each expert. A
    scatter-add, not ``bincount``: CUDA's bincount reads its input's maximum on the host."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


class _AllToAllV(torch.autograd.Function):
    """Rows to their ranks; the backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, group: ParallelGroup, send: list[int], recv: list[int]) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return group.all_to_all_v(rows, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.group.all_to_all_v(grad, ctx.recv, ctx.send), None, None, None


def all_to_all_v(rows: Tensor, group: ParallelGroup, send: list[int], recv: list[int]) -> Tensor:
    """:meth:`ParallelGroup.all_to_all_v` with a backward (the reverse all-to-all); the identity on one rank."""
    return rows if group.size == 1 else _AllToAllV.apply(rows, group, send, recv)


@dataclass(frozen=True)
class Dispatched:
    """One layer call's routing, from :meth:`TokenDispatcher.dispatch` to :meth:`TokenDispatcher.combine`.

    Attributes:
        order: the pairs' order sorted by expert, ``[n·k]`` (indices into the token-major pairs).
        by_expert: the received rows' order grouped by local expert, ``[R]``.
        send, recv: the all-to-all's split sizes per rank (rows).
        tokens_per_expert: rows each local expert received (host integers).
        expert_counts: the same, ``[E/e]`` on the device (the grouped GEMM's offsets, without a host copy).
        shape: ``(n, k)``.
    """

    order: Tensor
    by_expert: Tensor
    send: list[int]
    recv: list[int]
    tokens_per_expert: list[int]
    expert_counts: Tensor
    shape: tuple[int, int]


class TokenDispatcher:
    """Dispatch and combine over an expert-parallel group (see the module docstring).

    Args:
        group: the expert-parallel group (size e; one rank: no communication).
        num_experts: E, experts of the whole layer; each rank holds ``E/e``.

    Raises:
        ValueError: ``E`` not divisible by ``e``.
    """

    reads_sizes_on_host = True
    """The split sizes are read once per call (``.tolist()``): a host sync, and a graph break when compiled."""

    def __init__(self, group: ParallelGroup, num_experts: int) -> None:
        check_expert_split(num_experts, group.size)
        self.group, self.num_experts = group, num_experts
        self.num_local = num_experts // group.size

    def dispatch(self, tokens: Tensor, experts: Tensor, scores: Optional[Tensor] = None) -> tuple[Tensor, Dispatched]:
        """The rows this rank's experts compute, grouped by local expert.

        Args:
            tokens: ``[n, h]``, this rank's tokens.
            experts: ``[n, k]`` int64, the experts each token is routed to: global ids in ``[0, E)``, as a router's
                top-k gives them (not checked: a check would read them on the host, a second synchronisation).
            scores: unused (every pair is computed); taken as :class:`~lightning_seqpar.moe.capacity.CapacityDispatcher`
                takes them.

        Returns:
            ``[R, h]`` rows for the local experts (``R = sum(tokens_per_expert)``), and the routing for
            :meth:`combine`.
        """
        n, k = experts.shape
        e, local = self.group.size, self.num_local
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = tokens.index_select(0, order // k)  # pair p belongs to token p // k
        counts = pairs_per_expert(flat, self.num_experts).view(e, local)  # [destination rank, local expert]
        received = self.group.all_to_all(counts) if e > 1 else counts  # [source rank, local expert]
        sizes = torch.cat([counts.sum(1), received.reshape(-1)]).tolist()  # the layer's one host read
        send, per_source = sizes[:e], [sizes[e + j * local: e + (j + 1) * local] for j in range(e)]
        recv = [sum(row) for row in per_source]
        tokens_per_expert = [sum(row[i] for row in per_source) for i in range(local)]
        arrived = all_to_all_v(rows, self.group, send, recv)
        expert_of = torch.repeat_interleave(torch.arange(local, device=tokens.device).repeat(e),
                                            received.reshape(-1).to(tokens.device), output_size=sum(recv))  # no read
        by_expert = torch.argsort(expert_of, stable=True)
        routing = Dispatched(order, by_expert, send, recv, tokens_per_expert, received.sum(0).to(tokens.device), (n, k))
        return arrived.index_select(0, by_expert), routing

    def combine(self, outputs: Tensor, routing: Dispatched, scores: Tensor) -> Tensor:
        """Each token's expert outputs summed, weighted by ``scores`` ``[n, k]``: ``[n, h]``.

        Args:
            outputs: ``[R, h]``, the local experts' outputs in :meth:`dispatch`'s row order.
        """
        n, k = routing.shape
        arrived = outputs.index_select(0, torch.argsort(routing.by_expert))  # back to source-rank order
        returned = all_to_all_v(arrived, self.group, routing.recv, routing.send)  # [n·k, h], sorted by expert
        pairs = returned.index_select(0, torch.argsort(routing.order))  # token-major
        # The product in the wider of the two dtypes (a float32 router's scores times bfloat16 outputs), as
        # transformers' experts weight each output before adding it.
        return (pairs.view(n, k, -1) * scores.unsqueeze(-1)).sum(1).to(pairs.dtype)
