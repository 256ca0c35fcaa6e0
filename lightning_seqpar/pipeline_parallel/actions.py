"""The unit every pipeline schedule is made of: one forward, backward or weight-gradient action of one model chunk on
one micro-batch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """``kind`` ``"F"``, ``"B"`` or ``"W"`` of model chunk ``chunk`` on micro-batch ``microbatch`` (``"B"``: the whole
    backward, or its input-gradient half where the schedule has W actions)."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
