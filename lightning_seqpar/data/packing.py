"""Rows of ``s`` tokens made of supervised examples: packed several to a row, or one per row padded.

**Packed** (the default): examples are placed in order, a new row started when the next one does not fit (no
example is split across rows). Position ids restart at 0 at each example, as transformers'
``DataCollatorWithFlattening`` makes them: the strategy's document-aware attention keeps each example to itself
(on one rank and under context parallelism), and the first token of each example has label ``-100``, so no position
is trained to predict across a boundary. The row's tail after its last example is padding: its own document with
label ``-100``.

**Padded** (``packing=False``): one example per row, padded at the end; ``attention_mask`` is 0 at padding.

Labels are aligned with the inputs (Hugging Face's convention: the model shifts them): ``labels[i]`` is ``ids[i]``
where the example supervises token i, else ``-100``.

Shapes: ``input_ids``, ``labels``, ``position_ids`` / ``attention_mask`` ``[rows, s]`` int64.

Raises (:func:`pack_examples`): ``ValueError`` for an example longer than ``s`` under ``overflow="refuse"``, naming
the example and both fixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_seqpar.data.supervised import SupervisedExample

IGNORE = -100
OVERFLOW = ("refuse", "truncate")


@dataclass(frozen=True)
class Rows:
    """Training rows (see the module docstring); ``second`` is ``position_ids`` when packed, else ``attention_mask``."""

    input_ids: np.ndarray
    labels: np.ndarray
    second: np.ndarray
    packed: bool

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def supervised(self) -> np.ndarray:
        """Supervised tokens per row ``[rows]``: those whose label is not ``-100``, after Hugging Face's shift (the
        first label of a row is never predicted)."""
        return (self.labels[:, 1:] != IGNORE).sum(1)

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_ids, labels, second)`` ``[len(rows), s]`` of the rows ``rows``."""
        return self.input_ids[rows], self.labels[rows], self.second[rows]


def example_too_long(where: str, n: int, s: int) -> str:
    """The refusal of an example of ``n`` tokens, longer than the block of ``s``, naming both fixes."""
    return (f"{where}: {n} tokens, longer than the block of {s}. Drop or split it, raise data.block_size, or set "
            f"data.overflow=truncate to keep its first {s} tokens.")


def _fit(example: SupervisedExample, s: int, overflow: str, where: str) -> SupervisedExample:
    if len(example) <= s:
        return example
    if overflow == "truncate":
        return SupervisedExample(example.ids[:s], example.supervised[:s])
    raise ValueError(example_too_long(where, len(example), s))


def pack_examples(examples: Sequence[SupervisedExample], s: int, pad_id: int, packing: bool = True,
                  overflow: str = "refuse", names: Sequence[str] = ()) -> Rows:
    """Rows of ``s`` tokens from ``examples`` (see the module docstring); ``names[i]`` names example i in errors."""
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r}: one of {OVERFLOW}.")
    fitted = [_fit(e, s, overflow, names[i] if i < len(names) else f"example {i}") for i, e in enumerate(examples)]
    groups: list[list[SupervisedExample]] = []
    for example in fitted:
        if packing and groups and sum(map(len, groups[-1])) + len(example) <= s:
            groups[-1].append(example)
        else:
            groups.append([example])
    ids = np.full((len(groups), s), pad_id, dtype=np.int64)
    labels = np.full((len(groups), s), IGNORE, dtype=np.int64)
    second = np.zeros((len(groups), s), dtype=np.int64)
    for row, group in enumerate(groups):
        at = 0
        for example in group:
            n = len(example)
            ids[row, at:at + n] = example.ids
            labels[row, at:at + n] = np.where(example.supervised, example.ids, IGNORE)
            labels[row, at] = IGNORE  # the previous example's last position never predicts this one
            if packing:
                second[row, at:at + n] = np.arange(n)
            else:
                second[row, at:at + n] = 1
            at += n
        if packing and at < s:  # the tail: a padding document of its own
            second[row, at:] = np.arange(s - at)
    return Rows(ids, labels, second, packing)
