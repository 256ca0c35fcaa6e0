"""A grid of ranks with named dimensions, and the groups that vary along some of them.

Megatron-Core's ``RankGenerator`` (``megatron/core/parallel_state.py``): the world is laid out as a grid whose
dimensions are listed fastest first (``tp-cp-dp-pp``: tensor-parallel neighbours are consecutive ranks). The group
of a set of dimensions holds the ranks that differ only along those dimensions; groups are listed with the other
dimensions' coordinates counted fastest first, and ranks inside a group with its own dimensions counted fastest first
(:meth:`RankGrid.groups` gives Megatron's ``get_ranks`` order exactly, which the tests pin).

Two grids over the same ranks make "MoE parallel folding" (Megatron-Core): the dense grid ``(tp, cp, dp, pp)`` for
attention and dense MLPs, the expert grid ``(etp, ep, edp, pp)`` for experts; both end in the same ``pp`` so the
pipeline groups agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class RankGrid:
    """Ranks ``0 .. world_size - 1`` laid out along named dimensions, fastest first.

    Attributes:
        dims: ``((name, size), ...)``, the fastest-varying dimension first.
    """

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"A grid names each dimension once, got {names}.")
        for name, size in self.dims:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Grid dimension {name!r} must be a positive integer, got {size!r}.")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def world_size(self) -> int:
        return _product(size for _, size in self.dims)

    def size(self, name: str) -> int:
        """The size of dimension ``name``."""
        return dict(self.dims)[self._known(name)]

    def _known(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"No dimension {name!r} in this grid; it has {list(self.names)}.")
        return name

    def _strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for name, size in self.dims:
            strides[name] = step
            step *= size
        return strides

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate along every dimension."""
        out = {}
        for name, size in self.dims:
            out[name] = rank % size
            rank //= size
        return out

    def rank(self, coordinates: dict[str, int]) -> int:
        """The rank at ``coordinates`` (every dimension named)."""
        strides = self._strides()
        return sum(coordinates[name] * strides[name] for name in self.names)

    def groups(self, names: Sequence[str]) -> list[list[int]]:
        """Every group of ranks that differ only along ``names`` (Megatron-Core's ``RankGenerator.get_ranks``):
        groups ordered by the other dimensions' coordinates, fastest first; ranks in a group by ``names``' own
        coordinates in grid order, fastest first."""
        inside = [(n, s) for n, s in self.dims if n in {self._known(n) for n in names}]
        outside = [(n, s) for n, s in self.dims if n not in {n for n, _ in inside}]
        strides = self._strides()
        out = []
        for outer in _counting(outside):
            base = sum(outer[n] * strides[n] for n, _ in outside)
            out.append([base + sum(inner[n] * strides[n] for n, _ in inside) for inner in _counting(inside)])
        return out

    def group_of(self, names: Sequence[str], rank: int) -> list[int]:
        """The group along ``names`` holding ``rank``."""
        here = self.coordinates(rank)
        inside = {self._known(n) for n in names}
        fixed = {n: c for n, c in here.items() if n not in inside}
        return [self.rank({**fixed, **inner}) for inner in _counting([(n, s) for n, s in self.dims if n in inside])]


def _counting(dims: Sequence[tuple[str, int]]) -> Iterable[dict[str, int]]:
    """Every coordinate of ``dims``, the first dimension fastest."""
    total = _product(size for _, size in dims)
    for index in range(total):
        coordinate = {}
        for name, size in dims:
            coordinate[name] = index % size
            index //= size
        yield coordinate


def _product(values: Iterable[int]) -> int:
    out = 1
    for value in values:
        out *= value
    return out
