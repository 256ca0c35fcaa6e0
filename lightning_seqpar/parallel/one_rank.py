"""A decision made by one rank and taken by every rank: its value, or its exception raised on every rank.

For work that is deterministic and the same on every rank (the rewrite's self-check, the auto layout's planner
probes): one rank spends the CPU, the others wait in one broadcast for the verdict. An exception travels too, so a
refusal reaches every rank at once and none waits for a collective that will not come.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def decided_by_one_rank(decide: Callable[[], T], is_source: bool, broadcast: Callable[[Any], Any]) -> T:
    """``decide()`` on the source rank, its result on every rank.

    Args:
        decide: the decision (called on the source rank only).
        is_source: whether this rank decides (the one ``broadcast`` sends from).
        broadcast: a broadcast of one picklable object from the source rank (the strategy's ``broadcast``: one host
            round trip).

    Raises:
        Exception: what ``decide`` raised on the source rank (its type and message; the traceback stays there).
    """
    value: Any = None
    error: Any = None
    if is_source:
        try:
            value = decide()
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = _sendable(exc)
    value, error = broadcast((value, error))
    if error is not None:
        raise error
    return value


def _sendable(error: Exception) -> Exception:
    """``error`` if it pickles and unpickles (the broadcast must not fail on the deciding rank alone, leaving the
    others waiting), else a ``RuntimeError`` carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to travel: send its text instead
        return RuntimeError(f"{type(error).__name__}: {error}")
