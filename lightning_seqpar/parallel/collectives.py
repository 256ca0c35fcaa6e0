"""A process group with the contiguous collectives tensor and sequence parallelism need.

Every collective of the library goes through :class:`ParallelGroup`, so one object both runs the
communication and (optionally) records it: attach a :class:`CommunicationLog` to ``group.log`` and
each collective appends its kind and the bytes one rank moves. Nothing here is global: a model
holds the group it was built with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"`` (``full_bytes``: the local
            tensor, of which ``(t−1)/t`` leaves the rank), ``"all_to_all_v"`` (splits of any sizes; ``full_bytes``: the
            rows that leave the rank, its own split excluded) or ``"ring_send"`` (one message to the next rank of a
            ring; ``full_bytes``: the message).
        full_bytes: size of the *global* (unsharded) tensor in bytes, ``numel · element_size``.
        group_size: number of ranks t taking part.
    """

    kind: str
    full_bytes: int
    group_size: int

    @property
    def bytes_moved(self) -> int:
        """Bytes one rank sends under the ring algorithm (NCCL's "bus bytes").

        All-gather and reduce-scatter each move ``(t-1)/t · N``; an all-reduce is a reduce-scatter
        followed by an all-gather, ``2 (t-1)/t · N`` (Korthikanti et al. 2022, §4.2.2).
        """
        if self.kind in ("ring_send", "all_to_all_v"):  # what leaves the rank, counted as such
            return self.full_bytes
        factor = 2 if self.kind == "all_reduce" else 1
        return factor * (self.group_size - 1) * self.full_bytes // self.group_size


@dataclass
class CommunicationLog:
    """Records the collectives a :class:`ParallelGroup` runs (attach with ``group.log = CommunicationLog()``)."""

    records: list[CollectiveRecord] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "all_gather start", "all_gather wait", ... of async collectives

    def event(self, what: str) -> None:
        """Note a moment in order (the start and completion of a collective run asynchronously)."""
        self.events.append(what)

    def count(self, kind: str) -> int:
        """Number of collectives of ``kind`` recorded."""
        return sum(r.kind == kind for r in self.records)

    def bytes_moved(self, kind: Optional[str] = None) -> int:
        """Bytes one rank sent (ring model), over all records or those of ``kind``."""
        return sum(r.bytes_moved for r in self.records if kind is None or r.kind == kind)

    def clear(self) -> None:
        """Forget every record and event."""
        self.records.clear()
        self.events.clear()


ASYNC_COLLECTIVE = "lightning_seqpar_async_collective"
ASYNC_GROUP = "lightning_seqpar_async_group"


class Pending:
    """A collective in flight (``torch.distributed``'s ``Work``): :meth:`wait` returns its result once it is done.

    Started before independent compute and waited for after it, the communication runs while the compute does
    (Megatron-LM's ``async_tensor_model_parallel_allreduce`` / overlapped sequence-parallel backward). On CUDA the
    overlap also needs the collective's kernel to be scheduled before the compute's: ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
    """

    def __init__(self, result: Tensor, work: Optional[Any] = None, kind: str = "",
                 log: Optional[CommunicationLog] = None, group: Optional[str] = None) -> None:
        self._result, self._work, self.kind, self._log, self._group = result, work, kind, log, group

    def wait(self) -> Tensor:
        """The result, once the collective is done.

        Raises:
            RuntimeError: the collective failed or timed out; the exception carries the collective's name in its
                ``ASYNC_COLLECTIVE`` attribute and its process group's description in ``ASYNC_GROUP`` (its traceback
                holds no ``torch.distributed`` frame to name them by).
        """
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as error:
                setattr(error, ASYNC_COLLECTIVE, self.kind)
                setattr(error, ASYNC_GROUP, self._group)
                raise
            self._work = None
            if self._log is not None:
                self._log.event(f"{self.kind} wait")
        return self._result


class _Works:
    """Several ``Work`` handles waited for as one (a batch of point-to-point operations)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class ParallelGroup:
    """A process group and this rank's place in it.

    Args:
        group: the ``torch.distributed`` process group, or ``None`` for a group of one rank
            (every collective is then the identity, so the same model code runs unparallelized).

    Collectives work on dimension 0 unless told otherwise, so that sequence-first activations
    ``[s, b, h]`` are gathered and scattered without copies (Megatron-LM ``mappings.py``).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.log: Optional[CommunicationLog] = None

    @classmethod
    def virtual(cls, size: int, rank: int = 0) -> "ParallelGroup":
        """A group of ``size`` ranks with no process group behind it, for planning (``explain``).

        Its collectives raise ``RuntimeError``.
        """
        group = cls(None)
        group.size, group.rank = size, rank
        return group

    def __repr__(self) -> str:
        return f"ParallelGroup(size={self.size}, rank={self.rank})"

    def __getstate__(self) -> dict:
        # Process groups cannot be pickled; a pickled model is a description of one rank's shard.
        return {"group": None, "size": self.size, "rank": self.rank, "log": None}

    def _record(self, kind: str, full: Tensor) -> None:
        if self.group is None:
            raise RuntimeError(f"A virtual ParallelGroup of size {self.size} cannot run {kind}.")
        if self.log is not None:
            self.log.records.append(CollectiveRecord(kind, full.numel() * full.element_size(), self.size))

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """Reduce ``tensor`` in place over the group and return it (same shape on every rank)."""
        if self.size == 1:
            return tensor
        self._record("all_reduce", tensor)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``: local ``[n, ...]`` → global ``[t·n, ...]``."""
        if self.size == 1:
            return tensor
        if dim == 0:
            return self._all_gather_single(tensor, async_op=False)[0]
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._record("all_gather", tensor.new_empty((self.size * tensor.numel(),)))
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        """Sum over the group and keep this rank's slice of dim 0: global ``[t·n, ...]`` → local ``[n, ...]``.

        Raises:
            ValueError: dim 0 not divisible by the group size.
        """
        if self.size == 1:
            return tensor
        return self._reduce_scatter_single(tensor, async_op=False)[0]

    def all_reduce_start(self, tensor: Tensor) -> Pending:
        """:meth:`all_reduce` (sum, in place), started and returned in flight (:class:`Pending`)."""
        if self.size == 1:
            return Pending(tensor)
        self._record("all_reduce", tensor)
        return self._pending("all_reduce", tensor, dist.all_reduce(tensor, group=self.group, async_op=self._eager()))

    def all_gather_start(self, tensor: Tensor) -> Pending:
        """:meth:`all_gather` along dim 0, started and returned in flight (:class:`Pending`)."""
        if self.size == 1:
            return Pending(tensor)
        return self._pending("all_gather", *self._all_gather_single(tensor, async_op=self._eager()))

    def reduce_scatter_start(self, tensor: Tensor) -> Pending:
        """:meth:`reduce_scatter`, started and returned in flight (:class:`Pending`)."""
        if self.size == 1:
            return Pending(tensor)
        return self._pending("reduce_scatter", *self._reduce_scatter_single(tensor, async_op=self._eager()))

    @staticmethod
    def _eager() -> bool:
        """Whether a ``*_start`` collective runs in flight. Under ``torch.compile`` it is issued synchronously
        (``Pending`` holds the result): dynamo traces collectives into functional ones only with ``async_op=False``,
        and the compiler then places their waits itself (inductor's comm/compute reordering), which is what the
        eager overlap does by hand."""
        return not torch.compiler.is_compiling()

    def ring_exchange_start(self, tensor: Tensor) -> Pending:
        """Send ``tensor`` to the next rank of the group's ring (``rank + 1 mod size``) and receive the previous
        rank's tensor of the same shape, started and returned in flight (:class:`Pending`: the received tensor).

        Both transfers are posted as one ``batch_isend_irecv``, the send first, on every rank: NCCL matches
        point-to-point messages by the order they were posted (tags are ignored), and with every rank posting the
        same pattern the i-th send from a rank meets the i-th receive of its successor; a batch completes as a whole,
        so no rank blocks in a send its peer has not yet answered.
        """
        if self.size == 1:
            return Pending(tensor)
        tensor = tensor.contiguous()
        self._record("ring_send", tensor)
        received = torch.empty_like(tensor)
        following = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        preceding = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, following, self.group),
                                        dist.P2POp(dist.irecv, received, preceding, self.group)])
        return self._pending("ring_send", received, _Works(works))

    def all_to_all(self, tensor: Tensor) -> Tensor:
        """``tensor`` ``[size, ...]``: slice ``i`` goes to rank ``i``; returns ``[size, ...]`` whose slice ``j`` came
        from rank ``j`` (``all_to_all_single``)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        self._record("all_to_all", tensor)
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=self.group)
        return out

    def all_to_all_v(self, tensor: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        """Rows of ``tensor`` (``[sum(send_splits), ...]``, grouped by destination rank in rank order) sent to their
        ranks; returns ``[sum(recv_splits), ...]``, grouped by source rank (``all_to_all_single`` with split sizes).
        The split sizes are host integers, exchanged beforehand (a host read: NCCL needs them to size the buffers).

        Raises:
            ValueError: split lists that are not one per rank, or that do not add up to ``tensor``'s rows.
        """
        if len(send_splits) != self.size or len(recv_splits) != self.size or sum(send_splits) != tensor.shape[0]:
            raise ValueError(f"all_to_all_v over {self.size} ranks needs one split per rank adding up to the rows: "
                             f"send {send_splits} for {tensor.shape[0]} rows, receive {recv_splits}.")
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.group is None:
            raise RuntimeError(f"A virtual ParallelGroup of size {self.size} cannot run all_to_all_v.")
        if self.log is not None:
            row = math.prod(tensor.shape[1:]) * tensor.element_size()
            leaving = sum(n for rank, n in enumerate(send_splits) if rank != self.rank)
            self.log.records.append(CollectiveRecord("all_to_all_v", leaving * row, self.size))
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, recv_splits, send_splits, group=self.group)
        return out

    def _all_gather_single(self, tensor: Tensor, async_op: bool) -> tuple[Tensor, Any]:
        tensor = tensor.contiguous()
        out = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self._record("all_gather", out)
        return out, dist.all_gather_single(out, tensor, group=self.group, async_op=async_op)

    def _reduce_scatter_single(self, tensor: Tensor, async_op: bool) -> tuple[Tensor, Any]:
        if tensor.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size ({self.size})."
            )
        tensor = tensor.contiguous()
        out = torch.empty((tensor.shape[0] // self.size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self._record("reduce_scatter", tensor)
        return out, dist.reduce_scatter_single(out, tensor, group=self.group, async_op=async_op)

    def _pending(self, kind: str, result: Tensor, work: Any) -> Pending:
        if work is None:  # run synchronously (_eager)
            return Pending(result)
        if self.log is not None:
            self.log.event(f"{kind} start")
        description = "default_pg" if self.group is None else getattr(self.group, "group_desc", None)
        return Pending(result, work, kind, self.log, description)

    def split(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim`` (no communication)."""
        if self.size == 1:
            return tensor
        if tensor.shape[dim] % self.size:
            raise ValueError(
                f"Cannot split dimension {dim} of size {tensor.shape[dim]} over {self.size} ranks: "
                f"it must be divisible by the tensor-parallel size."
            )
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()

    def gather(self, tensor: Tensor) -> Optional[Tensor]:
        """Every rank's ``tensor`` (same shape everywhere) stacked on group rank 0: ``[t, *shape]``; ``None`` elsewhere.

        Received one rank at a time straight into the result (point-to-point, in rank order, so NCCL's in-order
        matching holds), so the receiving rank allocates exactly ``t`` times ``tensor``, where a ``gather`` collective
        may stage a second copy (gloo does).
        """
        if self.size == 1:
            return tensor.unsqueeze(0)
        tensor = tensor.contiguous()
        self._record("gather", torch.empty((self.size * tensor.numel(),), dtype=tensor.dtype, device="meta"))
        if self.rank != 0:
            dist.send(tensor, dst=dist.get_global_rank(self.group, 0), group=self.group)
            return None
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        out[0].copy_(tensor)
        for source in range(1, self.size):
            dist.recv(out[source], src=dist.get_global_rank(self.group, source), group=self.group)
        return out

    def broadcast(self, tensor: Tensor, src_rank: int = 0) -> Tensor:
        """Overwrite ``tensor`` in place with group rank ``src_rank``'s copy."""
        if self.size == 1:
            return tensor
        self._record("broadcast", tensor)
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src_rank), group=self.group)
        return tensor
