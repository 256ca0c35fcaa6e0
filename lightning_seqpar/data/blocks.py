"""Fixed-length training samples over a token array that may be a memory-mapped file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_seqpar.data.token_file import open_bin, open_tokens


@dataclass(frozen=True, eq=False)
class TokenSource:
    """Where a corpus's ids are: a ``.tokens`` file, a headerless ``.bin`` of ``dtype``, or an in-memory array.
    Picklable by path, so a DataLoader worker maps the file itself instead of receiving a copy of the ids."""

    path: Optional[Path] = None
    kind: str = "tokens"  # "tokens" | "bin" | "memory"
    dtype: str = "uint16"
    array: Optional[np.ndarray] = None

    def open(self) -> np.ndarray:
        if self.kind == "memory":
            assert self.array is not None
            return self.array
        assert self.path is not None
        return open_tokens(self.path)[1] if self.kind == "tokens" else open_bin(self.path, self.dtype)


class BlockDataset(Dataset):
    """Consecutive, non-overlapping blocks of ids ``[start, end)`` of a source: item i is ``(x, y)`` with
    ``x = ids[start + i·s : start + i·s + s]`` and ``y`` the same window shifted by one token; shapes ``[s]``,
    int64. Only the items read are paged in.

    Raises:
        ValueError: a range that cannot fill one block of ``block_size + 1``, naming the split and the fixes.
    """

    def __init__(self, source: TokenSource, start: int, end: int, block_size: int, split: str = "corpus") -> None:
        if end - start <= block_size:
            raise ValueError(
                f"The {split} split has {end - start} tokens, which cannot fill one block of {block_size} + 1. Use a "
                f"larger corpus, a smaller block_size{', or a larger val_fraction' if split == 'validation' else ''}."
            )
        self.source, self.start, self.end, self.block_size = source, start, end, block_size
        self._ids: Optional[np.ndarray] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ids": None}  # a worker maps the file again rather than copying the ids

    def __len__(self) -> int:
        return (self.end - self.start - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if self._ids is None:
            self._ids = self.source.open()
        first = self.start + i * self.block_size
        chunk = torch.from_numpy(np.asarray(self._ids[first:first + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]
