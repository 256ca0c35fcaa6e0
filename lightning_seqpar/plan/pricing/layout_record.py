"""One layout the planner considers, and what it predicts for it: the record :func:`~..planner.plan` returns and
``python -m lightning_seqpar.plan --json`` prints. The layout itself is a :class:`~lightning_seqpar.Layout`, the value
the strategy takes; the record adds the batch's shape on a rank and the predictions. Its own module so the parts that
price a layout (:mod:`.kept`, :mod:`.rules`) read it without importing the planner back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_seqpar.layout import Layout


@dataclass
class LayoutRecord:
    """One layout the planner considered (``--json`` prints these).

    Attributes:
        layout: the :class:`~lightning_seqpar.Layout` priced (sizes, schedule and micro-batches, ZeRO and main params,
            recomputation and offload, ``cp_comm``, ``loss_chunk``). A rank of ``cp = c`` holds ``s/c`` tokens; a
            Hugging Face model split over tp or cp ranks whose ``s/c`` exceeds ``loss_chunk`` keeps no logits or
            softmax for backward: each chunk's are made again there, one chunk at a time.
        dp: replicas reading different batches (context-parallel peers excluded: the data group that reduces
            gradients and shards ZeRO has ``d·c`` ranks).
        micro_batch: sequences per micro-batch on a rank.
        feasible: it passes every rule and fits in memory.
        reason: why not (``None`` when feasible).
        bytes: the most loaded rank's predicted bytes at its step's peak: ``parameters``, ``gradients`` (none of
            a step's first backward's ``.grad`` when it peaks there; the last step's when it peaks in a forward),
            ``main_params``, ``optimizer``, ``activations`` (kept by the micro-batches in flight), ``other`` (what
            exists only at that moment: a forward's or a backward's transients, pipeline buffers, or the optimizer's
            temporaries: :mod:`.transients`), ``total``.
        stage: the most loaded pipeline rank.
        flops: model and hardware FLOPs per step (Eq. 7, Eq. 8).
        collective_bytes: bytes each rank sends per step, by kind (``tensor``, ``data``, ``pipeline``, ``expert``:
            the dispatch and combine all-to-alls of a mixture of experts, and ``context``: the context-parallel
            attention's ring or all-to-all transfers).
        bubble: the pipeline bubble's fraction of the compute time.
        step_time: predicted seconds per step and its terms.
        timing: ``measured rates`` when the step time read a calibration (:mod:`..measuring.calibration`), else ``rough
            estimate`` (nominal rates: an assumed fraction of peak FLOP/s and link bandwidths).
        why: for a layout :func:`plan` made by trading (``memory_choices=True``): why it recomputes by module or
            offloads (what the same layout needs without).
        host: with ``offload``: ``moved_per_step`` (bytes one rank copies to the host per step, and back) and ``held``
            (bytes waiting there at its peak): :mod:`.memory_choices`.
        state_floor: with :func:`~..planner.plan`'s ``state_floor``, a layout whose model state alone (parameters,
            gradients, main params, optimizer state and its step's temporary, on its most loaded rank) exceeds the
            GPU: those bytes, a floor of its peak; its activations were not priced (``bytes`` empty). 0 otherwise.
        other: what ``bytes["other"]`` is made of at the peak: ``forward`` (the last layer's core attention
            temporaries at the end of a forward, the last step's gradients still alive), ``backward`` (a backward's
            transients),
            ``accumulated_gradients`` (``.grad`` beside the data-parallel buckets) or ``optimizer`` (its step's
            temporary).
    """

    layout: Layout
    dp: int
    micro_batch: int
    feasible: bool = False
    reason: Optional[str] = None
    bytes: dict[str, int] = field(default_factory=dict)
    stage: int = 0
    flops: dict[str, float] = field(default_factory=dict)
    collective_bytes: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    step_time: dict[str, float] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    why: Optional[str] = None
    timing: str = "rough estimate"
    state_floor: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
