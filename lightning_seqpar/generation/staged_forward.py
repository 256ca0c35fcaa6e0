"""One generation forward through the pipeline stages, each rank running the stages it holds.

Training runs stages through a schedule of micro-batches; a generation step is one micro-batch of one forward, so the
stages run in their order: the holder of stage i runs the model's own forward as stage i
(:meth:`~lightning_seqpar.pipeline_parallel.stage.StageRuntime.run`: its layers, the activation received at its first
layer, :class:`~lightning_seqpar.pipeline_parallel.stage.StageOutput` at its last) and hands the activation to the
holder of stage i + 1 through the training's own transport (:class:`~lightning_seqpar.pipeline_parallel.p2p.
StageTransport`: shape headers only with a step of new shapes, i.e. the prefill and the first decode step; messages
matched by their order, as NCCL needs). Every placement works alike, V included (a rank holding stages 0 and 2p−1 runs
both, receiving in between). The last stage's rank chooses the token; it is broadcast over the pipeline group.

Each rank's key/value cache holds its own layers' keys and values; the other layers' slots are advanced by one byte
per position (``[1, 1, s, 1]``), so that transformers' mask sizes (read from the cache's first layer of each kind)
count the positions on every stage.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_seqpar.pipeline_parallel.comm_plan import ACTIVATION, Batch, Transfer, carries_header


class StagedForward:
    """The generation forwards of one rank of a pipelined model (see the module docstring).

    Args:
        steps: the strategy's :class:`~lightning_seqpar.lightning.pipelined_steps.PipelinedSteps` (its executor's
            runtime, transport and pipeline group).
    """

    def __init__(self, steps: Any) -> None:
        executor = steps.executor
        self.runtime, self.transport, self.group = executor.runtime, executor.transport, steps.pipeline
        self.layout = self.runtime.layout
        self.last_rank = self.layout.rank_of(self.layout.num_stages - 1)
        stages = self.layout.stages_of(self.group.rank)
        held = {layer for stage in stages for layer in range(*self.layout.bounds(stage))}
        self.remote_layers = [i for i in range(self.layout.num_layers) if i not in held]

    @property
    def chooses(self) -> bool:
        """Whether this rank holds the last stage (it computes the logits and chooses the token)."""
        return self.group.rank == self.last_rank

    def __call__(self, forward: Callable[[], Any], signature: tuple) -> Optional[Tensor]:
        """Run ``forward`` (the model's call, returning the next position's logits ``[b, v]``) as each stage this rank
        holds, in stage order; return those logits on the last stage's rank, else ``None``. ``signature``: what the
        activations' shapes depend on (positions, rows, whether sequence parallelism splits them)."""
        exchange = self.transport.begin_step(("generate",) + signature)
        payload, last = self.runtime.payload, self.layout.num_stages - 1
        payload.forget()
        message: tuple[Tensor, ...] = ()
        logits = None
        for stage in range(self.layout.num_stages):
            if self.layout.rank_of(stage) != self.group.rank:
                continue
            incoming = None
            if stage > 0:
                previous = self.layout.rank_of(stage - 1)
                if previous != self.group.rank:  # else the stage before ran here: its message is at hand
                    message = self._receive(stage, previous, exchange)
                incoming = message[0]
            payload.forward_begins(stage, 0, tuple(message[1:]), self.transport.device)
            sent, out = self.runtime.run(stage, incoming, forward)
            if stage == last:
                payload.forward_ends()
                logits = out
                continue
            if not sent:
                raise RuntimeError(f"Stage {stage} finished the generation forward without reaching its last layer.")
            message = (out, *payload.forward_sends(stage, 0, training=False))
            following = self.layout.rank_of(stage + 1)
            if following != self.group.rank:
                self._send(stage + 1, following, message, exchange)
        return logits

    def _transfer(self, send: bool, stage: int, peer: int, header: bool) -> Batch:
        return Batch((Transfer(send, ACTIVATION, stage, 0, peer, header),))

    def _send(self, stage: int, peer: int, message: tuple[Tensor, ...], exchange: bool) -> None:
        outgoing = {(ACTIVATION, stage, 0): message}
        if exchange and carries_header(Transfer(True, ACTIVATION, stage, 0, peer), self.layout):
            self.transport.post(self._transfer(True, stage, peer, True), outgoing).wait()
        self.transport.post(self._transfer(True, stage, peer, False), outgoing).wait()

    def _receive(self, stage: int, peer: int, exchange: bool) -> tuple[Tensor, ...]:
        if exchange and carries_header(Transfer(False, ACTIVATION, stage, 0, peer), self.layout):
            self.transport.post(self._transfer(False, stage, peer, True), {}).wait()
        return self.transport.post(self._transfer(False, stage, peer, False), {}).wait()[(ACTIVATION, stage, 0)]

    def share(self, token: Optional[Tensor], logprob: Optional[Tensor], rows: int, device: torch.device
              ) -> tuple[Tensor, Tensor]:
        """The last stage's chosen tokens ``[b]`` and their log-probabilities ``[b]`` (float32) on every rank of the
        pipeline group (one broadcast of both, packed as float64: token ids are exact in it below 2⁵³)."""
        packed = torch.empty(2, rows, dtype=torch.float64, device=device)
        if self.chooses:
            assert token is not None and logprob is not None
            packed[0], packed[1] = token.to(torch.float64), logprob.to(torch.float64)
        self.group.broadcast(packed, self.last_rank)
        return packed[0].to(torch.int64), packed[1].to(torch.float32)

    def advance_remote(self, cache: Any, positions: int, device: torch.device) -> None:
        """Count ``positions`` more in the cache slots of the layers other ranks hold: ``[1, 1, positions, 1]`` entries
        (transformers counts a slot's positions only where it holds elements), one byte each."""
        marker = torch.zeros(1, 1, positions, 1, dtype=torch.uint8, device=device)
        for layer in self.remote_layers:
            cache.update(marker, marker, layer)
