"""Dropout random streams for tensor and sequence parallelism (Megatron-LM ``CudaRNGStatesTracker``).

Ranks of a tensor-parallel group must draw

* the **same** dropout masks where they hold the same tensor (replicated regions: the hidden
  dropouts without sequence parallelism), and
* **different** masks where they hold different data: the sequence-sharded dropouts under SP,
  and attention-probability / FFN dropouts on sharded heads or features.

The default generator serves the first case (it is seeded identically on the group); the
*tensor-parallel* stream, seeded ``seed + 2718 + tp_rank``, serves the second. :meth:`RNGTracker.fork`
swaps a stream into the device's default generator for the duration of a block, so plain
``F.dropout`` draws from it; recomputation replays masks because
:func:`recomputed` restores the stream states it had in forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

TENSOR_PARALLEL_STREAM = "tensor-parallel"
_TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron-LM's offset, kept so seeds mean the same thing there


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named random streams for one device.

    Args:
        device: the device whose default generator the streams replace inside :meth:`fork`.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def for_tensor_parallel(cls, seed: int, tp_rank: int, device: torch.device | str = "cpu") -> "RNGTracker":
        """A tracker with the tensor-parallel stream seeded ``seed + 2718 + tp_rank``."""
        tracker = cls(device)
        tracker.add(TENSOR_PARALLEL_STREAM, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` from ``seed``.

        Raises:
            ValueError: if the stream exists.
        """
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists.")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states taken by :meth:`get_states`."""
        self.states = {name: state.clone() for name, state in states.items()}

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is untouched by it."""
        outside = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(outside, self.device)


@contextmanager
def maybe_fork(tracker: Optional[RNGTracker], sharded: bool) -> Iterator[None]:
    """Fork the tensor-parallel stream when ``sharded`` and a tracker is given; else do nothing."""
    if sharded and tracker is not None:
        with tracker.fork():
            yield
    else:
        yield


def recomputed(function: Callable, *args: Any, rng_tracker: Optional[RNGTracker] = None, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward; recompute it there, drawing the
    dropout masks it drew the first time.

    ``torch.utils.checkpoint`` restores the default generator when it recomputes, but not the tracker's
    streams, which have advanced since the forward pass: they are snapshot here and swapped in while
    recomputing (Megatron-LM's ``CheckpointFunction`` does the same for its CUDA RNG tracker). Built on
    non-reentrant ``torch.utils.checkpoint.checkpoint`` with ``preserve_rng_state=True``. Numerically identical
    to calling ``function`` directly.
    """
    if torch.compiler.is_compiling():
        # Traced, the checkpoint is a region of the graph whose ops the partitioner recomputes in the backward graph:
        # no Python reruns, so no streams to swap back (dropout from a tracker's stream is refused under compile).
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
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
