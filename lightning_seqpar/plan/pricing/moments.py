"""When a pipeline rank starts each backward, and what it holds then, read from the schedule itself
(:func:`~lightning_seqpar.pipeline_parallel.schedules.build_schedule`): the planner prices each such moment's bytes.
"""

from __future__ import annotations

import functools
from typing import Optional

from lightning_seqpar.pipeline_parallel.schedules import (
    V_SHAPED, build_schedule, resolve_schedule, runs_at, splits_backward,
)


@functools.lru_cache(maxsize=4096)
def backward_moments(schedule: str, m: int, pp: int, vpp: int, rank: int
                      ) -> tuple[tuple[tuple[int, ...], int, tuple[bool, ...], tuple[int, ...]], ...]:
    """The distinct moments at which pipeline rank ``rank`` starts a backward (a B) in ``schedule``: the forwards in
    flight then, counted per model chunk; the backward's chunk; per chunk, whether its weights' gradients exist (an
    earlier backward of that chunk ran; under a split backward that chunk's W: a B makes no weight gradient); the
    micro-batches past their B and waiting for their W, per chunk (a split backward)."""
    moments: dict[tuple[tuple[int, ...], int, tuple[bool, ...], tuple[int, ...]], None] = {}
    counts, waiting, made = [0] * vpp, [0] * vpp, [False] * vpp
    split = splits_backward(schedule)
    for action in build_schedule(schedule, m, pp, vpp, rank):
        if action.kind == "F":
            counts[action.chunk] += 1
        elif action.kind == "B":
            moments[(tuple(counts), action.chunk, tuple(made), tuple(waiting))] = None
            made[action.chunk] = made[action.chunk] or not split
            counts[action.chunk] -= 1
            waiting[action.chunk] += split
        else:
            waiting[action.chunk] -= 1
            made[action.chunk] = True
    return tuple(moments)


def chunks_rule(schedule: str, vpp: int) -> Optional[str]:
    """Why ``schedule`` cannot run ``vpp`` model chunks per rank (ZB-H1 runs one, ZB-V two), or ``None``."""
    try:
        name = resolve_schedule(schedule, 1)
    except ValueError:  # the interleaved schedule by name: from two chunks on
        try:
            resolve_schedule(schedule, vpp)
        except ValueError as error:
            return str(error)
        return None
    if runs_at(name, vpp):
        return None
    return (f"{name} runs two model chunks per rank in a V (vpp={vpp})" if name in V_SHAPED
            else f"{name} runs one model chunk per rank (vpp={vpp})")
