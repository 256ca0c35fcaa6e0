"""t ranks of a tensor-parallel group emulated by t threads of one process, so that parallel layers can be run
and checked without any process group (the rewrite's self-check). Each collective is computed from every
thread's tensor, exactly as ``torch.distributed`` would combine them."""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import CollectiveRecord, ParallelGroup, Pending

_WAIT_S = 60.0  # a thread that waits longer at a collective has lost a peer to an error


class _Exchange:
    """What the threads of one emulated group share: one slot per rank and a barrier."""

    def __init__(self, size: int) -> None:
        self.slots: list[Optional[Tensor]] = [None] * size
        self.barrier = threading.Barrier(size, timeout=_WAIT_S)

    def gather(self, rank: int, tensor: Tensor) -> list[Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        every = list(self.slots)  # type: ignore[arg-type]
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return every


class EmulatedGroup(ParallelGroup):
    """Rank ``rank`` of an emulated group of ``size`` ranks (one thread each; see :func:`run_emulated`).

    all-reduce (sum, max, min), all-gather, reduce-scatter, broadcast, the ring exchange and the all-to-alls give what
    they give on a real group; the sum is taken in rank order on every rank, so every rank holds bitwise the same
    result.
    """

    def __init__(self, size: int, rank: int, exchange: _Exchange) -> None:
        super().__init__(None)
        self.size, self.rank, self._exchange = size, rank, exchange

    def _note(self, kind: str, full_bytes: int) -> None:
        """Record the collective as a real group records it (``full_bytes``: the global tensor)."""
        if self.log is not None:
            self.log.records.append(CollectiveRecord(kind, full_bytes, self.size))

    def all_reduce(self, tensor: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        self._note("all_reduce", tensor.numel() * tensor.element_size())
        return self._reduced(tensor, op)

    def _reduced(self, tensor: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        combine = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}
        if op not in combine:
            raise NotImplementedError(f"An emulated group reduces by SUM, MAX or MIN, got {op}.")
        parts = self._exchange.gather(self.rank, tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total = combine[op](total, part)
        tensor.copy_(total)
        return tensor

    def all_gather(self, tensor: Tensor, dim: int = 0) -> Tensor:
        self._note("all_gather", self.size * tensor.numel() * tensor.element_size())
        return torch.cat(self._exchange.gather(self.rank, tensor.contiguous()), dim=dim)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        self._note("reduce_scatter", tensor.numel() * tensor.element_size())
        total = self._reduced(tensor.contiguous().clone())
        return total.chunk(self.size, dim=0)[self.rank].contiguous()

    def all_gather_start(self, tensor: Tensor) -> Pending:
        return Pending(self.all_gather(tensor))  # threads of one process: done at once, in the same order

    def reduce_scatter_start(self, tensor: Tensor) -> Pending:
        return Pending(self.reduce_scatter(tensor))

    def ring_exchange_start(self, tensor: Tensor) -> Pending:
        every = self._exchange.gather(self.rank, tensor.clone())  # from the previous rank of the ring, at once
        return Pending(every[(self.rank - 1) % self.size])

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> Tensor:
        self._note("broadcast", tensor.numel() * tensor.element_size())
        tensor.copy_(self._exchange.gather(self.rank, tensor.clone())[src_rank])
        return tensor

    def all_to_all(self, tensor: Tensor) -> Tensor:
        every = self._exchange.gather(self.rank, tensor.clone())
        return torch.stack([sent[self.rank] for sent in every])

    def all_to_all_v(self, tensor: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        row = math.prod(tensor.shape[1:]) * tensor.element_size()
        leaving = sum(n for rank, n in enumerate(send_splits) if rank != self.rank)
        self._note("all_to_all_v", leaving * row)  # what leaves the rank, as a real group records it
        every = self._exchange.gather(self.rank, tensor.clone())
        splits = self._exchange.gather(self.rank, torch.tensor(send_splits))
        pieces = [sent.split(sizes.tolist())[self.rank] for sent, sizes in zip(every, splits)]
        if [len(p) for p in pieces] != list(recv_splits):
            raise ValueError(f"all_to_all_v: rank {self.rank} expects {recv_splits} rows, the others send "
                             f"{[len(p) for p in pieces]}.")
        return torch.cat(pieces)


def run_emulated(size: int, function: Callable[[ParallelGroup], Any]) -> list[Any]:
    """``function(group)`` on each of ``size`` emulated ranks at once; the results in rank order.

    Raises:
        the first exception a rank raised (the others are released from their collectives).
    """
    exchange = _Exchange(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = function(EmulatedGroup(size, rank, exchange))
        except threading.BrokenBarrierError:
            pass  # another rank failed first: its error is reported
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
