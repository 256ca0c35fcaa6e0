"""Point-to-point transfers between pipeline stages.

Each message is preceded by a small header (dtype and shape), so a stage needs no shape
inference and a model may send any ``[s/t, b, h]`` shard. Sends are asynchronous and only receives
wait: the schedules never form a cycle of receives (``schedules.simulate``), so nothing deadlocks,
and a send's buffer is released as soon as the transfer completes. Tags name the message
(activation or gradient, receiving virtual stage, micro-batch), so transfers between the same two
ranks can be received in any order.

Under sequence parallelism the tensor sent is the local ``[s/t, b, h]`` shard and the peer is the
rank with the same tensor- and data-parallel coordinates in the neighbouring stage (Korthikanti
et al. 2022 §4.2.2): the pipeline group contains exactly those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype code, ndim, up to 8 sizes
ACTIVATION, GRADIENT = 0, 1


@dataclass
class TransferLog:
    """Bytes this rank sent to other stages.

    Attributes:
        payload: ``(kind, bytes)`` per message: ``"activation"`` forward, ``"gradient"`` backward;
            ``numel · element_size`` of the tensor sent.
        header_bytes: bytes of the shape headers (not counted in ``payload``).
    """

    payload: list[tuple[str, int]] = field(default_factory=list)
    header_bytes: int = 0

    def bytes(self, kind: str | None = None) -> int:
        """Payload bytes sent, over all messages or those of ``kind``."""
        return sum(n for k, n in self.payload if kind is None or k == kind)

    def clear(self) -> None:
        """Forget every record."""
        self.payload.clear()
        self.header_bytes = 0


class StageTransport:
    """Sends and receives of one pipeline rank.

    Args:
        group: the pipeline-parallel group (ranks holding the same tensor/data-parallel shard).
        num_stages: virtual stages ``p·v`` (tags are unique per stage and micro-batch).
        num_microbatches: m.
        device: where received tensors are placed.
    """

    def __init__(self, group: ParallelGroup, num_stages: int, num_microbatches: int, device: torch.device) -> None:
        self.group, self.num_stages, self.num_microbatches, self.device = group, num_stages, num_microbatches, device
        self.log = TransferLog()
        self._pending: dict[tuple[int, int, int], tuple[list[dist.Work], list[Tensor]]] = {}

    def _peer(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group.group, pipeline_rank)

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return 2 * ((kind * self.num_stages + stage) * self.num_microbatches + microbatch)

    def send(self, tensor: Tensor, kind: int, to_stage: int, microbatch: int, to_rank: int) -> None:
        """Start sending ``tensor`` for virtual stage ``to_stage`` (on pipeline rank ``to_rank``).

        The buffer stays referenced until :meth:`release` (or :meth:`wait_all`) sees the transfer done.
        """
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"Pipeline stages exchange tensors of at most {_HEADER - 2} dimensions, got {tuple(tensor.shape)}.")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        tag, peer = self._tag(kind, to_stage, microbatch), self._peer(to_rank)
        works = [dist.isend(header, peer, group=self.group.group, tag=tag + 1),
                 dist.isend(tensor, peer, group=self.group.group, tag=tag)]
        self._pending[(kind, to_stage, microbatch)] = (works, [header, tensor])
        self.log.payload.append(("activation" if kind == ACTIVATION else "gradient", tensor.numel() * tensor.element_size()))
        self.log.header_bytes += header.numel() * header.element_size()

    def recv(self, kind: int, stage: int, microbatch: int, from_rank: int) -> Tensor:
        """Wait for the tensor sent to virtual stage ``stage`` for ``microbatch`` by pipeline rank ``from_rank``."""
        tag, peer = self._tag(kind, stage, microbatch), self._peer(from_rank)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group.group, tag=tag + 1)
        ndim = int(header[1])
        out = torch.empty([int(n) for n in header[2 : 2 + ndim]], dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(out, peer, group=self.group.group, tag=tag)
        return out

    def release(self, kind: int, to_stage: int, microbatch: int) -> None:
        """Wait for one send and drop its buffer (the executor calls it once the reply proves delivery)."""
        works, _ = self._pending.pop((kind, to_stage, microbatch), ([], []))
        for work in works:
            work.wait()

    def wait_all(self) -> None:
        """Wait for every send started (end of a step)."""
        for works, _ in self._pending.values():
            for work in works:
                work.wait()
        self._pending.clear()
