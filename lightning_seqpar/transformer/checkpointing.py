"""Activation checkpointing that replays tensor-parallel dropout masks.

``torch.utils.checkpoint`` restores the default generator when it recomputes, but not the
streams of an :class:`~lightning_seqpar.tensor_parallel.random.RNGTracker`, which have advanced since
the forward pass. :func:`checkpoint` snapshots them in forward and swaps the snapshot in while
recomputing (what Megatron-LM's ``CheckpointFunction`` does for its CUDA RNG tracker), so a
recomputed dropout draws the mask it drew the first time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.utils.checkpoint

from lightning_seqpar.tensor_parallel.random import RNGTracker


def checkpoint(function: Callable, *args: Any, rng_tracker: Optional[RNGTracker] = None, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward; recompute it there.

    Non-reentrant ``torch.utils.checkpoint.checkpoint`` with ``preserve_rng_state=True``, plus the
    tracker replay described above. Numerically identical to calling ``function`` directly.
    """
    snapshot = rng_tracker.get_states() if rng_tracker is not None else None
    calls = 0

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1 or snapshot is None:
            return function(*inner_args, **inner_kwargs)
        current = rng_tracker.get_states()
        rng_tracker.set_states(snapshot)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            rng_tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
