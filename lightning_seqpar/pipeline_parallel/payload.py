"""What a model carries between pipeline stages beside each activation and its gradient.

The executor runs the schedule and moves messages; it does not know what a model adds to them. A message is the
activation (or its gradient) followed by the payload's ``parts`` tensors, posted in that order on both sides
(:class:`~lightning_seqpar.pipeline_parallel.p2p.StageTransport`). A model that carries nothing has
:class:`NoPayload`; a mixture of experts whose loss pools router statistics over every layer carries them
(:class:`~lightning_seqpar.moe.pipeline_losses.StageRouterLosses`).

Megatron-Core sends activations only and attaches each layer's auxiliary loss to the activation's backward
(``MoEAuxLossAutoScaler``); a term that needs every stage's values (a pooled loss) needs messages of its own, both
ways.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor


class StagePayload(Protocol):
    """The executor's calls, in a step's order, on the rank running ``stage``'s action for ``microbatch``.

    Attributes:
        parts: tensors carried beside each activation and each activation gradient (every rank of the pipeline
            alike: the transports are built with ``1 + parts`` tensors per message).
    """

    parts: int

    def forget(self) -> None:
        """At a step's start: drop what a step that raised may have left."""

    def forward_begins(self, stage: int, microbatch: int, received: tuple[Tensor, ...], device: torch.device) -> None:
        """Before ``stage``'s forward: what came beside its input activation (``()`` on the first stage)."""

    def forward_sends(self, stage: int, microbatch: int, training: bool) -> tuple[Tensor, ...]:
        """After a non-last stage's forward: the ``parts`` tensors to send on beside its output activation."""

    def forward_ends(self) -> None:
        """After the last stage's forward (its loss has been computed)."""

    def backward_sends(self, microbatch: int, device: torch.device) -> tuple[Tensor, ...]:
        """After the last stage's backward: the ``parts`` tensors sent back beside its input's gradient, of the shapes
        and dtypes of those sent beside the activation (a gradient's message has its activation's shapes:
        :class:`~lightning_seqpar.pipeline_parallel.p2p.StageTransport` refuses others)."""

    def backward_share(self, stage: int, microbatch: int, received: tuple[Tensor, ...]) -> Optional[Tensor]:
        """Before a non-last stage's backward, given what came beside the gradient: a scalar term of the loss whose
        gradient reaches this stage's parameters only (the executor scales it by ``1/m`` as the loss), or ``None``.
        What was received is passed on unchanged to the stage before."""


class NoPayload:
    """Nothing beside the activations: every call does nothing."""

    parts = 0

    def forget(self) -> None:
        pass

    def forward_begins(self, stage: int, microbatch: int, received: tuple[Tensor, ...], device: torch.device) -> None:
        pass

    def forward_sends(self, stage: int, microbatch: int, training: bool) -> tuple[Tensor, ...]:
        return ()

    def forward_ends(self) -> None:
        pass

    def backward_sends(self, microbatch: int, device: torch.device) -> tuple[Tensor, ...]:
        return ()

    def backward_share(self, stage: int, microbatch: int, received: tuple[Tensor, ...]) -> Optional[Tensor]:
        return None
