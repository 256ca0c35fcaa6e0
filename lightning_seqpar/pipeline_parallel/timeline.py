"""Where a pipelined step's host time goes, action by action: each forward (F), input-gradient backward (B) and
weight-gradient backward (W), each batch of sends and receives posted (post), each wait for a transfer (wait), and
what the executor does between them (other).

The executor laps a :class:`StepTimeline` after every segment of its step, so the segments tile the step: their sum is
the step's host time exactly, every action is timed once, and nothing is sampled. On CUDA the host time of an action
is the time to launch it (the device runs behind); a wait on a receive includes the device work the transfer waited for.
Measuring, not a model: :mod:`lightning_seqpar.pipeline_parallel.report` prices traces by fixed costs instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

KINDS = ("F", "B", "W", "post", "wait", "other")
"""What a segment of a step is: an action of the schedule, a batch of transfers posted, a wait, or the rest."""


@dataclass(frozen=True)
class Segment:
    """One timed segment of a step: ``kind`` (of :data:`KINDS`), the action's chunk and micro-batch (``None`` for the
    others) and its host seconds."""

    kind: str
    chunk: Optional[int]
    microbatch: Optional[int]
    seconds: float


@dataclass
class StepTimeline:
    """The segments of one rank's pipelined steps, in the order they ran.

    Attributes:
        segments: every segment of every step timed since :meth:`clear`.
        steps: each step's host seconds, from :meth:`start` to its last segment.
    """

    clock: Callable[[], float] = time.perf_counter
    segments: list[Segment] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    _last: Optional[float] = field(default=None, init=False, repr=False)
    _began: Optional[float] = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """A step begins now."""
        self._began = self._last = self.clock()

    def lap(self, kind: str, chunk: Optional[int] = None, microbatch: Optional[int] = None) -> None:
        """The segment since the last lap (or :meth:`start`) was ``kind``.

        Raises:
            ValueError: ``kind`` not in :data:`KINDS`.
            RuntimeError: outside a step.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
        if self._last is None:
            raise RuntimeError("StepTimeline.lap() before start(): the executor starts each step.")
        now = self.clock()
        self.segments.append(Segment(kind, chunk, microbatch, now - self._last))
        self._last = now

    def stop(self) -> None:
        """The step ends at the last lap."""
        assert self._began is not None and self._last is not None, "stop() without start()"
        self.steps.append(self._last - self._began)
        self._began = self._last = None

    def clear(self) -> None:
        """Forget what was timed (the step in progress keeps timing)."""
        self.segments.clear()
        self.steps.clear()

    def totals(self) -> dict[str, float]:
        """Host seconds per kind over the timed steps, every kind of :data:`KINDS` present."""
        out = dict.fromkeys(KINDS, 0.0)
        for segment in self.segments:
            out[segment.kind] += segment.seconds
        return out

    def counts(self) -> dict[str, int]:
        """Segments per kind over the timed steps."""
        out = dict.fromkeys(KINDS, 0)
        for segment in self.segments:
            out[segment.kind] += 1
        return out
