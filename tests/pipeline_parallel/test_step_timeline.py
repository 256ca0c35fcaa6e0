"""The executor's timeline on its own: laps tile a step, each named by its kind."""

from __future__ import annotations

import pytest

from lightning_seqpar.pipeline_parallel.timeline import KINDS, StepTimeline


def test_the_laps_tile_the_step_and_name_their_kind():
    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0])
    timeline = StepTimeline(clock=lambda: next(ticks))
    with pytest.raises(RuntimeError, match="before start"):
        timeline.lap("F")
    timeline.start()
    timeline.lap("F", 0, 0)
    timeline.lap("wait")
    with pytest.raises(ValueError, match="kind must be one of"):
        timeline.lap("X")
    timeline.lap("B", 0, 0)
    timeline.lap("other")
    timeline.stop()
    assert [(s.kind, s.seconds) for s in timeline.segments] == [("F", 1.0), ("wait", 2.0), ("B", 3.0), ("other", 4.0)]
    assert timeline.steps == [10.0] and sum(timeline.totals().values()) == 10.0
    assert timeline.counts() == dict.fromkeys(KINDS, 0) | {"F": 1, "B": 1, "wait": 1, "other": 1}
