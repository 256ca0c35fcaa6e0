"""How many elements a rank holds of a split: arithmetic the runtime splits by and the planner prices by, below both.

- a vocabulary split over t ranks is padded to a multiple of t (Megatron-LM's ``make_vocab_size_divisible_by``; the
  padded rows are masked out of the loss);
- the distributed optimizer (ZeRO-1) gives each of d data-parallel ranks ``ceil(numel / d)`` elements of a flattened
  tensor, the last ranges shorter or empty (Megatron-Core's ``DistributedOptimizer`` ranges over one tensor).
"""

from __future__ import annotations


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def owned_range(numel: int, d: int, rank: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of a flattened tensor of ``numel`` elements that data-parallel ``rank`` of ``d``
    owns (``ceil(numel / d)`` each, the last ranges shorter or empty)."""
    k = -(-numel // d)
    return min(rank * k, numel), min((rank + 1) * k, numel)
