"""Point-to-point transfers between pipeline stages, under NCCL's rules.

A rank's transfers are posted in the batches of its program (:mod:`~lightning_seqpar.pipeline_parallel.comm_plan`),
each as one ``torch.distributed.batch_isend_irecv``, in the program's order; the executor waits for a batch only when
an action needs what it receives (or the step ends), so transfers run under the actions between. No tag is used:
between two ranks, messages are matched by the order they were posted, on both sides the same
(:mod:`~lightning_seqpar.pipeline_parallel.nccl_model` checks it for every schedule).

A receive must know its tensor's shape and dtype before the message arrives. They are a function of the
micro-batch's shapes, which every stage sees alike, so they are exchanged only in the first step with a new
*signature* (the micro-batch's tensor shapes and dtypes, and whether the step is forward-only): there each
activation is preceded by a small header (dtype and shape), read on the host
(:func:`~lightning_seqpar.pipeline_parallel.comm_plan.with_headers`; a gradient has its activation's shape);
afterwards no transfer reads anything back to the host. A sender whose tensor does not have the recorded shape
raises (its peer is then left waiting in its receive until the process group's timeout).

Under sequence parallelism the tensor sent is the local ``[s/t, b, h]`` shard and the peer is the
rank with the same tensor- and data-parallel coordinates in the neighbouring stage (Korthikanti
et al. 2022 §4.2.2): the pipeline group contains exactly those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.pipeline_parallel.comm_plan import ACTIVATION, Batch, Transfer

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype code, ndim, up to 8 sizes
Message = tuple[str, int, int]
MessageValue = tuple[Tensor, ...]


@dataclass
class TransferLog:
    """Bytes this rank sent to other stages.

    Attributes:
        payload: ``(kind, bytes)`` per message: ``"activation"`` forward, ``"gradient"`` backward;
            ``numel · element_size`` of the tensor sent.
        header_bytes: bytes of the shape headers this rank sent or received (not counted in ``payload``).
        batches: ``batch_isend_irecv`` calls made.
    """

    payload: list[tuple[str, int]] = field(default_factory=list)
    header_bytes: int = 0
    batches: int = 0

    def bytes(self, kind: str | None = None) -> int:
        """Payload bytes sent, over all messages or those of ``kind``."""
        return sum(n for k, n in self.payload if kind is None or k == kind)

    def clear(self) -> None:
        """Forget every record."""
        self.payload.clear()
        self.header_bytes = 0
        self.batches = 0


class StageTransport:
    """The sends and receives of one pipeline rank: runs the batches of its program, as they are.

    Args:
        group: the pipeline-parallel group (ranks holding the same tensor/data-parallel shard).
        device: where received tensors are placed.
        parts: tensors per message: the activation or its gradient, then what the model carries beside it
            (:class:`~lightning_seqpar.pipeline_parallel.payload.StagePayload`; every rank of the pipeline builds its
            transport alike).
        one_shape: every stage boundary carries the shapes of the first stage's output (the V placement, whose
            steps exchange headers on the first boundaries only:
            :func:`~lightning_seqpar.pipeline_parallel.comm_plan.carries_header`); a tensor of other shapes raises.

    The first batch of point-to-point operations in an NCCL group must involve every rank of it, unless the
    group's communicator exists: a one-element all-reduce at construction creates it.
    """

    def __init__(self, group: ParallelGroup, device: torch.device, parts: int = 1, one_shape: bool = False) -> None:
        self.group, self.device = group, torch.device(device)
        self.parts, self.one_shape = parts, one_shape
        self.log = TransferLog()
        # (signature, receiving stage) -> shape and dtype of each tensor of the activation sent to that stage
        self._shapes: dict[tuple[Hashable, int], tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}
        self._signatures: set[Hashable] = set()
        self._signature: Hashable = None
        if group.size > 1:
            group.all_reduce(torch.zeros(1, device=self.device))

    def begin_step(self, signature: Hashable) -> bool:
        """Start a step whose micro-batches have ``signature``; return whether it exchanges shapes (the signature is
        new: run :func:`~lightning_seqpar.pipeline_parallel.comm_plan.with_headers`' program). Every rank of the
        pipeline decides alike: they see the same micro-batches."""
        new = signature not in self._signatures
        self._signatures.add(signature)
        self._signature = signature
        return new

    def _peer(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group.group, pipeline_rank)

    def _key(self, stage: int) -> tuple[Hashable, int]:
        return self._signature, 0 if self.one_shape else stage

    def _shape(self, t: Transfer) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        # A gradient has the shape of the activation its receiver sent to the next stage.
        return self._shapes[self._key(t.stage if t.kind == ACTIVATION else t.stage + 1)]

    def _tensors(self, message: MessageValue) -> tuple[Tensor, ...]:
        tensors = tuple(message)
        if len(tensors) != self.parts:
            raise RuntimeError(f"A pipeline message of {len(tensors)} tensors, where this transport sends {self.parts}.")
        return tensors

    def post(self, batch: Batch, outgoing: dict[Message, MessageValue]) -> "PostedBatch":
        """Post ``batch`` as one ``batch_isend_irecv``, in its order: send the tensors its sends name (taken from
        ``outgoing`` once their payload goes) and receive its messages; the transfers run while the caller goes on,
        until :meth:`PostedBatch.wait` (which a batch whose shape headers the next batches need must get at once).

        A message is a tuple of :attr:`parts` tensors (the activation or its gradient, then what the model carries
        beside it: :mod:`~lightning_seqpar.pipeline_parallel.payload`), posted one after another in that order on both
        sides.

        Raises:
            ValueError: a header for a tensor of more than 8 dimensions or of a dtype the header cannot name.
            RuntimeError: a tensor whose shape or dtype is not the one recorded for its message in this
                signature's first step (its peer then waits until the process group's timeout).
        """
        ops: list[dist.P2POp] = []
        received: dict[Message, list[Tensor]] = {}
        headers: list[tuple[Transfer, list[Tensor]]] = []
        for t in batch.transfers:
            peer = self._peer(t.peer)
            if t.send and t.header:
                tensors = self._tensors(outgoing[t.message])
                self._shapes[self._key(t.stage)] = tuple((tuple(x.shape), x.dtype) for x in tensors)
                for tensor in tensors:
                    header = self._header(tensor)
                    ops.append(dist.P2POp(dist.isend, header, peer, self.group.group))
                    self.log.header_bytes += header.numel() * header.element_size()
            elif t.send:
                tensors = tuple(x.detach().contiguous() for x in self._tensors(outgoing.pop(t.message)))
                specs = self._shape(t)
                if tuple((tuple(x.shape), x.dtype) for x in tensors) != specs:
                    raise RuntimeError(
                        f"Pipeline stage {t.stage - 1 if t.kind == 'activation' else t.stage + 1} sends a {t.kind} of "
                        f"shapes {[(tuple(x.shape), x.dtype) for x in tensors]} for micro-batch {t.microbatch}, where "
                        f"micro-batches of the same shapes sent {list(specs)}. What a stage sends must depend only on "
                        f"the micro-batch's shapes"
                        f"{', and be the same at every stage boundary in the V placement' if self.one_shape else ''}."
                    )
                for tensor in tensors:
                    ops.append(dist.P2POp(dist.isend, tensor, peer, self.group.group))
                    self.log.payload.append((t.kind, tensor.numel() * tensor.element_size()))
            elif t.header:
                parts = [torch.empty(_HEADER, dtype=torch.int64, device=self.device) for _ in range(self.parts)]
                for header in parts:
                    ops.append(dist.P2POp(dist.irecv, header, peer, self.group.group))
                    self.log.header_bytes += header.numel() * header.element_size()
                headers.append((t, parts))
            else:
                received[t.message] = [torch.empty(shape, dtype=dtype, device=self.device)
                                       for shape, dtype in self._shape(t)]
                for tensor in received[t.message]:
                    ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group.group))
        self.log.batches += 1
        return PostedBatch(self, dist.batch_isend_irecv(ops), ops, received, headers)

    def _read_headers(self, headers: list[tuple[Transfer, list[Tensor]]]) -> None:
        """Record the shapes the received ``headers`` name (the transport's only reads to the host: in a signature's
        first step)."""
        for t, parts in headers:
            specs = []
            for header in parts:
                code, ndim, *sizes = header.tolist()
                specs.append((tuple(sizes[:ndim]), _DTYPES[code]))
            self._shapes[self._key(t.stage)] = tuple(specs)

    def _header(self, tensor: Tensor) -> Tensor:
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise ValueError(f"Pipeline stages exchange tensors of at most {_HEADER - 2} dimensions and dtypes "
                             f"{_DTYPES}; got {tuple(tensor.shape)} {tensor.dtype}.")
        values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape, *[0] * (_HEADER - 2 - tensor.dim())]
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def shapes_signature(microbatch: object, forward_only: bool) -> Hashable:
    """What the shapes sent between stages depend on: every tensor's shape and dtype in ``microbatch`` (any
    nesting of lists, tuples and dicts), and whether the step is forward-only. Host metadata only."""
    leaves: list[tuple] = []

    def visit(value: object) -> None:
        if isinstance(value, Tensor):
            leaves.append((tuple(value.shape), value.dtype))
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                visit(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(microbatch)
    return forward_only, tuple(leaves)


class PostedBatch:
    """A batch of transfers in flight (:meth:`StageTransport.post`): its tensors, sent and to be received, are held
    until :meth:`wait`, so none is freed or reused while the transfer may still read or write it."""

    def __init__(self, transport: StageTransport, works: list, ops: list, received: dict[Message, list[Tensor]],
                 headers: list[tuple[Transfer, list[Tensor]]]) -> None:
        self._transport, self._works, self._ops = transport, works, ops
        self._received, self._headers = received, headers

    def wait(self) -> dict[Message, MessageValue]:
        """Wait for every transfer of the batch; return what it received, by message."""
        for work in self._works:
            work.wait()
        self._transport._read_headers(self._headers)
        received = {m: tuple(tensors) for m, tensors in self._received.items()}
        self._works, self._ops, self._received, self._headers = [], [], {}, []
        return received
