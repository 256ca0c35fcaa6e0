"""One rank of a tensor-parallel group run alone, its peers taken to be its mirrors: the planner's probes.

A probe reads the bytes one rank keeps for backward (:mod:`lightning_seqpar.plan.measuring.probe`); those depend on the
shapes each collective delivers, never on the values. The probes' sizes divide evenly over the ranks, so every rank
holds the shapes rank 0 holds, and what a collective delivers to rank 0 has the shape it would have if its peers sent
what rank 0 sends. So one rank, one thread, costs the same at any t: t emulated threads
(:mod:`lightning_seqpar.parallel.emulated`) each rebuilt and ran the model to hand rank 0 its peers' tensors, which
made a probe at t 8 eight times one at t 1.

Each collective returns a new tensor (as a real one does: its storage is counted where it is made) whose values
are what the group would compute if every rank held this one's tensor: a sum ``t`` times it, a gather ``t`` copies.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup, Pending


class MirroredGroup(ParallelGroup):
    """Rank ``rank`` of a group of ``size`` ranks, run alone: every peer holds what this rank holds (see the module
    docstring). Only for measuring what one rank keeps: a model run on it computes no real parallel result.

    Raises:
        ValueError (from :meth:`reduce_scatter`, :meth:`all_to_all_v`): shapes a real group would refuse.
    """

    def __init__(self, size: int, rank: int = 0) -> None:
        super().__init__(None)
        self.size, self.rank = size, rank

    def all_reduce(self, tensor: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        if op == dist.ReduceOp.SUM:
            return tensor.mul_(self.size)
        if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            return tensor
        raise NotImplementedError(f"A mirrored group reduces by SUM, MAX or MIN, got {op}.")

    def all_gather(self, tensor: Tensor, dim: int = 0) -> Tensor:
        return torch.cat([tensor] * self.size, dim=dim)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        if tensor.shape[0] % self.size:
            raise ValueError(f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size "
                             f"({self.size}).")
        return tensor.chunk(self.size, dim=0)[self.rank] * self.size

    def all_reduce_start(self, tensor: Tensor) -> Pending:
        return Pending(self.all_reduce(tensor))

    def all_gather_start(self, tensor: Tensor) -> Pending:
        return Pending(self.all_gather(tensor))

    def reduce_scatter_start(self, tensor: Tensor) -> Pending:
        return Pending(self.reduce_scatter(tensor))

    def ring_exchange_start(self, tensor: Tensor) -> Pending:
        return Pending(tensor.clone())

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> Tensor:
        return tensor

    def gather(self, tensor: Tensor) -> Optional[Tensor]:
        return torch.stack([tensor] * self.size) if self.rank == 0 else None

    def all_to_all(self, tensor: Tensor) -> Tensor:
        return tensor[self.rank].expand_as(tensor).clone()  # slice j from rank j: its slice for this rank

    def all_to_all_v(self, tensor: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        if len(send_splits) != self.size or len(recv_splits) != self.size or sum(send_splits) != tensor.shape[0]:
            raise ValueError(f"all_to_all_v over {self.size} ranks needs one split per rank adding up to the rows: "
                             f"send {send_splits} for {tensor.shape[0]} rows, receive {recv_splits}.")
        mine = tensor.split(send_splits)[self.rank]  # the rows this rank keeps, as each peer sends its own
        rows = [mine[torch.arange(n) % max(1, len(mine))] if len(mine) else tensor.new_zeros((n, *tensor.shape[1:]))
                for n in recv_splits]
        return torch.cat(rows)
