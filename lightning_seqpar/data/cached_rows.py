"""Training rows read from the memory-mapped supervised cache, made when a micro-batch asks for them.

The same rows as :func:`~lightning_seqpar.data.packing.pack_examples` makes (packed in order, a new row when the next
example does not fit, or one example per row padded; the same labels, position ids and attention masks), but what a
rank holds is an index, not the rows: each row is a contiguous range of examples, so the index is the examples'
token offsets (8 bytes per example), each row's first example and its supervised-token count (16 bytes per row). The
ids and supervised flags stay in the cache's memory maps (the page cache every rank of a node shares), unread while
the index is built (the cache records each example's supervised count); a micro-batch reads its ``b`` rows' tokens
from them. Memory per rank is then bounded by the examples and rows counts, not by the
tokens: a 1 GB chat file no longer puts its rows on every rank.

Shapes: :meth:`CachedRows.take` returns ``input_ids``, ``labels``, ``second`` ``[k, s]`` int64 for ``k`` rows.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from lightning_seqpar.data.packing import IGNORE, Rows, example_too_long
from lightning_seqpar.data.supervised_cache import SupervisedCache


class CachedRows:
    """The rows of examples ``[first, last)`` of ``cache`` (see the module docstring).

    Args:
        cache: the opened supervised cache (memory maps).
        first, last: the examples of this split.
        s: tokens per row.
        pad_id: the id of padding tokens.
        packing: several examples per row (position ids restarting at each), or one per row with an attention mask.
        overflow: an example longer than ``s``: ``"refuse"`` or ``"truncate"`` (its first ``s`` tokens).
        name: what to call example ``i`` of the cache in an error.

    Raises:
        ValueError: an example longer than ``s`` under ``overflow="refuse"``, naming it and both fixes.
    """

    def __init__(self, cache: SupervisedCache, first: int, last: int, s: int, pad_id: int, packing: bool,
                 overflow: str, name: Callable[[int], str]) -> None:
        self.ids, self.flags, self.s, self.pad_id, self.packed = cache.ids, cache.supervised, s, pad_id, packing
        self.predicted = np.asarray(cache.predicted[first:last], dtype=np.int64)
        lengths = np.asarray(cache.lengths[first:last], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]) + int(np.sum(cache.lengths[:first], dtype=np.int64))
        too_long = np.flatnonzero(lengths > s)
        if len(too_long) and overflow != "truncate":
            raise ValueError(example_too_long(name(first + int(too_long[0])), int(lengths[too_long[0]]), s))
        self.fitted = np.minimum(lengths, s)  # a longer example keeps its first s tokens (overflow="truncate")
        self.row_starts = _rows_of(self.fitted, s, packing)
        self.supervised = self._supervised_per_row()

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def _supervised_per_row(self) -> np.ndarray:
        """``[rows]``: tokens whose label is not ``-100`` after Hugging Face's shift, as :attr:`Rows.supervised`: an
        example's flags but its first token's (never predicted across a boundary, the cache's ``predicted``), summed
        over the row's examples; the flags are read only for the few examples truncated to ``s``."""
        starts, fitted = self.offsets[:-1], self.fitted
        per_example = self.predicted.copy()
        for i in np.flatnonzero(fitted < self.offsets[1:] - starts):  # truncated: their first s tokens only
            begin = int(starts[i])
            per_example[i] = int(self.flags[begin + 1:begin + int(fitted[i])].sum(dtype=np.int64))
        return np.add.reduceat(per_example, self.row_starts[:-1]) if len(self) else np.zeros(0, np.int64)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_ids, labels, second)`` ``[len(rows), s]`` of the rows ``rows`` (``second``: position ids when
        packed, else the attention mask), read from the cache."""
        k, s = len(rows), self.s
        ids = np.full((k, s), self.pad_id, dtype=np.int64)
        labels = np.full((k, s), IGNORE, dtype=np.int64)
        second = np.zeros((k, s), dtype=np.int64)
        for out, row in enumerate(np.asarray(rows).tolist()):
            at = 0
            for example in range(int(self.row_starts[row]), int(self.row_starts[row + 1])):
                begin, n = int(self.offsets[example]), int(self.fitted[example])
                tokens = np.asarray(self.ids[begin:begin + n], dtype=np.int64)
                ids[out, at:at + n] = tokens
                labels[out, at:at + n] = np.where(np.asarray(self.flags[begin:begin + n], dtype=bool), tokens, IGNORE)
                labels[out, at] = IGNORE  # the previous example's last position never predicts this one
                second[out, at:at + n] = np.arange(n) if self.packed else 1
                at += n
            if self.packed and at < s:  # the tail: a padding document of its own
                second[out, at:] = np.arange(s - at)
        return ids, labels, second

    def materialize(self) -> Rows:
        """Every row at once, as :class:`~lightning_seqpar.data.packing.Rows` (for checks and small data: training
        reads rows through :meth:`take`)."""
        return Rows(*self.take(np.arange(len(self))), self.packed)

    @property
    def input_ids(self) -> np.ndarray:
        return self.materialize().input_ids

    @property
    def labels(self) -> np.ndarray:
        return self.materialize().labels

    @property
    def second(self) -> np.ndarray:
        return self.materialize().second


def _rows_of(fitted: np.ndarray, s: int, packing: bool) -> np.ndarray:
    """``[rows + 1]``: the first example of each row (and the end), packing in order as
    :func:`~lightning_seqpar.data.packing.pack_examples` does."""
    if not packing:
        return np.arange(len(fitted) + 1, dtype=np.int64)
    starts, used = [0], 0
    for i, n in enumerate(fitted.tolist()):
        if i and used + n > s:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(fitted))
    return np.asarray(starts if len(fitted) else [0], dtype=np.int64)
