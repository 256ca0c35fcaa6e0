"""Run a pipeline schedule: forwards and backwards of micro-batches through this rank's stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.p2p import ACTIVATION, GRADIENT, StageTransport
from lightning_seqpar.pipeline_parallel.schedules import Action, build_schedule
from lightning_seqpar.pipeline_parallel.stage import StageRuntime


@dataclass
class StepResult:
    """What one pipelined step produced on this rank.

    Attributes:
        outputs: the step function's result per micro-batch, on the rank holding the last stage (else empty).
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


class PipelineExecutor:
    """Runs one rank's actions of a schedule.

    Args:
        runtime: the :class:`StageRuntime` of the split model.
        transport: point-to-point sends and receives in the pipeline group (its rank is this rank's stage).
        config: schedule and m.

    Attributes:
        observers: callables run after each action with ``(action, in_flight)``, for measurements.
    """

    def __init__(self, runtime: StageRuntime, transport: StageTransport, config: PipelineConfig) -> None:
        self.runtime, self.transport, self.config = runtime, transport, config
        self.observers: list[Callable[[Action, int], None]] = []

    @property
    def layout(self) -> StageLayout:
        """The stage layout of the split model."""
        return self.runtime.layout

    @property
    def rank(self) -> int:
        """This rank's coordinate in the pipeline group."""
        return self.transport.group.rank

    def run(self, step: Callable[[int], Any], forward_only: bool = False) -> StepResult:
        """Run ``step(microbatch)`` (the user's step on micro-batch i) through the schedule.

        In training, the last stage's loss of each micro-batch is back-propagated scaled by ``1/m``, so
        the parameters' ``.grad`` hold the gradient of the mean micro-batch loss.
        """
        layout, m = self.layout, self.config.num_microbatches
        last = layout.num_stages - 1
        actions = build_schedule(self.config.schedule, m, layout.pp, layout.virtual_stages, self.rank, forward_only)
        result = StepResult()
        saved: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]] = {}
        for action in actions:
            stage = layout.stage(self.rank, action.chunk)
            key = (action.chunk, action.microbatch)
            if action.kind == "F":
                incoming = None
                if stage > 0:
                    incoming = self.transport.recv(ACTIVATION, stage, action.microbatch, layout.rank_of(stage - 1))
                    if not forward_only and incoming.is_floating_point():
                        incoming.requires_grad_()
                sent, out = self.runtime.run(stage, incoming, lambda i=action.microbatch: step(i))
                if stage < last:
                    if not sent:
                        raise RuntimeError(f"Stage {stage} finished the step without reaching its last layer.")
                    self.transport.send(out, ACTIVATION, stage + 1, action.microbatch, layout.rank_of(stage + 1))
                else:
                    result.outputs[action.microbatch] = out
                    out = loss_of(out) if not forward_only else out
                if not forward_only:
                    saved[key] = (incoming, out)
            else:
                incoming, out = saved.pop(key)
                if stage == last:
                    torch.autograd.backward(out / m)
                else:
                    grad = self.transport.recv(GRADIENT, stage, action.microbatch, layout.rank_of(stage + 1))
                    # The gradient came back, so the activation arrived: its send buffer can go.
                    self.transport.release(ACTIVATION, stage + 1, action.microbatch)
                    torch.autograd.backward(out, grad)
                if stage > 0:
                    assert incoming is not None
                    grad_in = incoming.grad if incoming.grad is not None else torch.zeros_like(incoming)
                    self.transport.send(grad_in, GRADIENT, stage - 1, action.microbatch, layout.rank_of(stage - 1))
                del incoming, out
            result.peak_in_flight = max(result.peak_in_flight, len(saved))
            for observe in self.observers:
                observe(action, len(saved))
        self.transport.wait_all()
        return result
