"""How a mixture of experts dispatches, as a value: the strategy's ``Layout.moe``. Torch-free, so the layout and the
planner's pricing hold it without loading the dispatchers (:mod:`.capacity`, :mod:`.dispatch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class DispatchConfig:
    """How a mixture of experts sends tokens to its experts.

    Attributes:
        capacity_factor: ``None``: dropless (every pair computed; the split sizes read on the host once per layer
            call, :class:`~lightning_seqpar.moe.dispatch.TokenDispatcher`); a positive float: at most
            ``⌈capacity_factor · n·k / E⌉`` pairs per expert from each rank's ``n`` tokens, no host read
            (:class:`~lightning_seqpar.moe.capacity.CapacityDispatcher`).
        drop_policy: which pairs an expert over capacity keeps: ``"probs"`` (highest router score) or ``"position"``
            (earliest tokens).

    Raises:
        ValueError: a capacity factor that is not a positive number; an unknown drop policy.
    """

    capacity_factor: Optional[float] = None
    drop_policy: Literal["probs", "position"] = "probs"

    def __post_init__(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise ValueError(f"capacity_factor={factor!r}: a positive number (1.0: each expert takes its even share "
                             f"n·k/E of a rank's pairs), or None for dropless dispatch.")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={self.drop_policy!r}: one of {', '.join(DROP_POLICIES)}.")
