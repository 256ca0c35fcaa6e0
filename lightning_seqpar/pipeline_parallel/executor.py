"""Run a pipeline schedule: forwards and backwards of micro-batches through this rank's stages.

What a model carries beside its activations is the runtime's payload's
(:class:`~lightning_seqpar.pipeline_parallel.payload.StagePayload`); the executor only moves it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor

from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.comm_plan import (ACTIVATION, GRADIENT, Batch, Step, build_program, needs,
                                                          with_headers)
from lightning_seqpar.pipeline_parallel.p2p import Message, MessageValue, PostedBatch, StageTransport
from lightning_seqpar.pipeline_parallel.schedules import Action, splits_backward
from lightning_seqpar.pipeline_parallel.stage import StageRuntime
from lightning_seqpar.pipeline_parallel.timeline import StepTimeline
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore


@dataclass
class StepResult:
    """What one pipelined step produced on this rank.

    Attributes:
        outputs: the step function's result per micro-batch, on the rank holding the last stage (else empty); in
            training, detached once its backward has run.
        peak_in_flight: most micro-batches (per chunk) whose activations this rank held at once.
    """

    outputs: dict[int, Any] = field(default_factory=dict)
    peak_in_flight: int = 0


def loss_of(output: Any) -> Tensor:
    """The loss of a ``training_step`` result: the tensor itself or its ``"loss"`` entry.

    Raises:
        ValueError: for ``None`` or a result without a tensor loss.
    """
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ValueError(
            f"Under pipeline parallelism training_step must return the loss (a tensor or a dict with 'loss'); "
            f"got {type(output).__name__}. Skipping a batch by returning None is not supported."
        )
    return loss


def _detached(output: Any) -> Any:
    """``output`` (a ``training_step`` result) without its graph: its tensors detached, a mapping as a ``dict``, a
    list or tuple as one (anything else as it is)."""
    if isinstance(output, Tensor):
        return output.detach()
    if isinstance(output, dict):
        return {k: _detached(v) for k, v in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(_detached(v) for v in output) if type(output) in (list, tuple) else output
    return output


class PipelineExecutor:
    """Runs one rank's actions of a schedule.

    Args:
        runtime: the :class:`StageRuntime` of the split model.
        transport: point-to-point sends and receives in the pipeline group (its rank is this rank's stage).
        config: schedule and m.
        weight_gradients: for a split schedule (ZB-H1, ZB-V, DualPipeV), the store the rank's split layers leave their
            weight gradients in (:func:`~lightning_seqpar.tensor_parallel.split_backward.split_weight_gradients`): each
            B runs deferring into it under ``(chunk, micro-batch)``, each W runs that group.

    Attributes:
        observers: callables run after each action with ``(action, in_flight)``, for measurements (in flight: the
            micro-batches whose forward ran and whose last backward action, W where there is one, has not).
        timeline: a :class:`~lightning_seqpar.pipeline_parallel.timeline.StepTimeline` that times every segment of
            each step (F, B, W, posts, waits, the rest), or ``None`` (default: nothing timed).

    Raises:
        ValueError: a schedule with W actions without ``weight_gradients``; a transport whose tensors per message
            are not the activation and the runtime's payload (:mod:`~lightning_seqpar.pipeline_parallel.payload`), or
            whose ``one_shape`` is not the V placement's.
    """

    def __init__(self, runtime: StageRuntime, transport: StageTransport, config: PipelineConfig,
                 weight_gradients: Optional[WeightGradientStore] = None) -> None:
        if splits_backward(config.schedule) and weight_gradients is None:
            raise ValueError(f"The {config.schedule} schedule runs W actions: give the executor the store its layers "
                             f"defer their weight gradients to (split_weight_gradients).")
        if transport.parts != 1 + runtime.payload.parts:
            raise ValueError(f"A transport of {transport.parts} tensors per message for a model that carries "
                             f"{runtime.payload.parts} beside each activation ({type(runtime.payload).__name__}): "
                             f"build it with parts={1 + runtime.payload.parts}.")
        if transport.one_shape != (runtime.layout.placement == "V"):
            raise ValueError(f"A transport {'with' if transport.one_shape else 'without'} one shape for every stage "
                             f"boundary for a model in the {runtime.layout.placement} placement: build it with "
                             f"one_shape={runtime.layout.placement == 'V'}.")
        self.runtime, self.transport, self.config = runtime, transport, config
        self.weight_gradients = weight_gradients
        self.observers: list[Callable[[Action, int], None]] = []
        self.timeline: Optional[StepTimeline] = None
        self._programs: dict[tuple[bool, bool], list[Step]] = {}  # (forward-only, with headers) -> program

    @property
    def layout(self) -> StageLayout:
        """The stage layout of the split model."""
        return self.runtime.layout

    @property
    def _splits(self) -> bool:
        return splits_backward(self.config.schedule)

    @property
    def rank(self) -> int:
        """This rank's coordinate in the pipeline group."""
        return self.transport.group.rank

    def run(self, step: Callable[[int], Any], forward_only: bool = False, signature: Hashable = None,
            before_last_backward: Optional[Callable[[int, bool], Any]] = None) -> StepResult:
        """Run ``step(microbatch)`` (the user's step on micro-batch i) through the schedule.

        In training, the last stage's loss of each micro-batch is back-propagated scaled by ``1/m``, so
        the parameters' ``.grad`` hold the gradient of the mean micro-batch loss. ``signature``: what the shapes
        sent between stages depend on (:func:`~lightning_seqpar.pipeline_parallel.p2p.shapes_signature`); they are
        exchanged in the first step of each signature only. ``before_last_backward(chunk, final, deferred)`` is called
        just before the last backward pass of each of this rank's model chunks (after it, that chunk's layers' gradients
        are final); ``final`` marks this rank's last backward of the step; ``deferred`` is ``None`` for an unsplit
        backward, else which parameters become final: those whose gradient W hands over (``True``, before the chunk's
        last W) or the others (``False``, before its last B).
        """
        clock = self.timeline or _NO_TIMELINE
        clock.start()
        headers = self.transport.begin_step((signature, forward_only))
        program = self._program(forward_only, headers)
        arming = self._arming(program)
        self.runtime.payload.forget()  # what a step that raised may have left
        run = _Step(step, forward_only, StepResult(), clock)
        for index, action in enumerate(program):
            if index in arming and before_last_backward is not None:
                before_last_backward(*arming[index])
            if isinstance(action, Batch):
                clock.lap("other")
                run.posted.append(self.transport.post(action, run.outgoing))
                clock.lap("post")
                if any(t.header and not t.send for t in action.transfers):
                    run.wait_all()
                continue
            needed = needs(action, self.layout, self.rank)  # (a stage on this rank hands its message over in memory)
            while needed is not None and needed.message not in run.received and run.posted:
                run.wait_next()
            clock.lap("other")
            if action.kind == "W":
                assert self.weight_gradients is not None
                self.weight_gradients.run((action.chunk, action.microbatch))
            elif action.kind == "F":
                self._forward(action, run)
            else:
                self._backward(action, run)
            clock.lap(action.kind, action.chunk, action.microbatch)
            held = len(run.saved) + (self.weight_gradients.pending if self._splits else 0)
            run.result.peak_in_flight = max(run.result.peak_in_flight, held)
            for observe in self.observers:
                observe(action, held)
        run.wait_all()
        clock.lap("other")
        clock.stop()
        assert not run.outgoing and not run.received, (run.outgoing.keys(), run.received.keys())
        return run.result

    def _program(self, forward_only: bool, headers: bool) -> list[Step]:
        key = (forward_only, headers)
        if key not in self._programs:
            plain = build_program(self.config.schedule, self.config.num_microbatches, self.layout, self.rank,
                                  forward_only)
            self._programs[key] = with_headers(plain, self.layout) if headers else plain
        return self._programs[key]

    def _arming(self, program: list[Step]) -> dict[int, tuple[int, bool, Optional[bool]]]:
        """Before each chunk's last backward: (chunk, this rank's last?, which parameters). Under a split backward the
        parameters outside the split layers get their last gradient in the chunk's last B (False), the split ones in
        its last W (True), which may come after later B's; unsplit, every one in the last B (None)."""
        arming: dict[int, tuple[int, bool, Optional[bool]]] = {}
        for kind, which in (("B", False if self._splits else None), ("W", True)):
            latest = {a.chunk: i for i, a in enumerate(program) if not isinstance(a, Batch) and a.kind == kind}
            arming.update({i: (chunk, i == max(latest.values()), which) for chunk, i in latest.items()})
        return arming

    def _forward(self, action: Action, run: "_Step") -> None:
        """F: run the user's step as this action's stage; send its output on, or keep the last stage's result."""
        stage, payload = self.layout.stage(self.rank, action.chunk), self.runtime.payload
        incoming, beside = None, ()
        if stage > 0:
            incoming, *rest = run.received.pop((ACTIVATION, stage, action.microbatch))
            beside = tuple(rest)
            if not run.forward_only and incoming.is_floating_point():
                incoming.requires_grad_()
        payload.forward_begins(stage, action.microbatch, beside, self.transport.device)
        sent, out = self.runtime.run(stage, incoming, lambda i=action.microbatch: run.step(i))
        if stage < self.layout.num_stages - 1:
            if not sent:
                raise RuntimeError(f"Stage {stage} finished the step without reaching its last layer.")
            self._hand_on((ACTIVATION, stage + 1, action.microbatch),
                          (out, *payload.forward_sends(stage, action.microbatch, training=not run.forward_only)), run)
        else:
            payload.forward_ends()
            run.result.outputs[action.microbatch] = out
            out = loss_of(out) if not run.forward_only else out
        if not run.forward_only:
            run.saved[(action.chunk, action.microbatch)] = (incoming, out)

    def _backward(self, action: Action, run: "_Step") -> None:
        """B: back-propagate the stage's output (the last stage's loss scaled by ``1/m``) and send the input's
        gradient, with what the payload carries back, to the stage before."""
        stage, payload = self.layout.stage(self.rank, action.chunk), self.runtime.payload
        key, last, m = (action.chunk, action.microbatch), self.layout.num_stages - 1, self.config.num_microbatches
        incoming, out = run.saved.pop(key)
        deferring = self.weight_gradients.deferring(key) if self._splits else contextlib.nullcontext()
        with deferring:
            if stage == last:
                torch.autograd.backward(out / m)
                beside = payload.backward_sends(action.microbatch, self.transport.device)
            else:
                grad, *rest = run.received.pop((GRADIENT, stage, action.microbatch))
                beside = tuple(rest)
                share = payload.backward_share(stage, action.microbatch, beside)
                roots, grads = ([out], [grad]) if share is None else ([out, share / m], [grad, None])
                torch.autograd.backward(roots, grads)
        if stage == last:
            # Kept for the step's result, the output would keep its graph's nodes, and through them the
            # stage input and its gradient, alive until the step ends: two [s/t, b, h] per micro-batch.
            run.result.outputs[action.microbatch] = _detached(run.result.outputs[action.microbatch])
        if stage > 0:
            assert incoming is not None
            grad_in = incoming.grad if incoming.grad is not None else torch.zeros_like(incoming)
            self._hand_on((GRADIENT, stage - 1, action.microbatch), (grad_in, *beside), run)

    def _hand_on(self, message: Message, value: MessageValue, run: "_Step") -> None:
        """Queue ``value`` for the stage ``message`` goes to: a send, or, where that stage is on this rank (the V
        placement's turn), straight into what this rank received, cut from the graph that made it as a transfer
        would (each stage back-propagates its own part, in its own action)."""
        _, stage, _ = message
        if self.layout.rank_of(stage) != self.rank:
            run.outgoing[message] = value
        else:
            run.received[message] = tuple(v.detach() for v in value)


class _NoTimeline:
    """What the executor laps when nothing is timed."""

    def start(self) -> None:
        pass

    def lap(self, kind: str, chunk: Optional[int] = None, microbatch: Optional[int] = None) -> None:
        pass

    def stop(self) -> None:
        pass


_NO_TIMELINE = _NoTimeline()


@dataclass
class _Step:
    """One :meth:`PipelineExecutor.run`'s state: the user's step, what is saved for backward, and the messages.

    Batches posted and not yet waited for are kept in program order: each is waited for when an action needs what it
    receives (or the step ends), so its transfers run under the actions between (Megatron-LM's overlapped p2p); one
    that receives shape headers at once, since the batches after it are built from the shapes it reads.
    """

    step: Callable[[int], Any]
    forward_only: bool
    result: StepResult
    clock: Any
    saved: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]] = field(default_factory=dict)
    outgoing: dict[Message, MessageValue] = field(default_factory=dict)
    received: dict[Message, MessageValue] = field(default_factory=dict)
    posted: deque[PostedBatch] = field(default_factory=deque)

    def wait_next(self) -> None:
        self.clock.lap("other")
        self.received.update(self.posted.popleft().wait())
        self.clock.lap("wait")

    def wait_all(self) -> None:
        while self.posted:
            self.wait_next()
