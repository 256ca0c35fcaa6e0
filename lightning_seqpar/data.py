"""Language-model data: the built-in corpus, any text, or nanoGPT-style token files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

BYTE_VOCAB_SIZE = 256


def builtin_corpus() -> str:
    """The Python reference documentation that ships with every CPython (``pydoc_data.topics``, ~465 kB).

    Real English-and-code text that needs no download.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_tokens(path: Optional[Union[str, Path]] = None, vocab_size: Optional[int] = None) -> tuple[Tensor, int]:
    """Token ids ``[n]`` (int64) and the vocabulary size of a corpus.

    Args:
        path: ``None`` for :func:`builtin_corpus`; a ``.bin`` file of uint16 tokens (nanoGPT's format); a
            text file; or a directory, whose text files are concatenated in sorted order. Text becomes
            UTF-8 bytes (vocabulary 256).
        vocab_size: the tokenizer's vocabulary for a ``.bin`` corpus (e.g. 50257 for GPT-2's); default:
            the largest id + 1. Ignored for text.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if it holds no tokens; a ``.bin`` file of an odd number of bytes (not uint16 ids); an
            id not below ``vocab_size``.
    """
    if path is None:
        data = builtin_corpus().encode("utf-8")
    else:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"No corpus at {path}.")
        if path.suffix == ".bin":
            return _load_uint16(path, vocab_size)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        data = b"\n\n".join(p.read_bytes() for p in files)
    if not data:
        raise ValueError(f"The corpus at {path} is empty.")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), BYTE_VOCAB_SIZE


def _load_uint16(path: Path, vocab_size: Optional[int]) -> tuple[Tensor, int]:
    size = path.stat().st_size
    if size % 2:
        raise ValueError(
            f"{path} holds {size} bytes, an odd number: a .bin corpus is a flat array of uint16 token ids (2 bytes "
            f"each, nanoGPT's format). The file is truncated or not a token file."
        )
    tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    if tokens.numel() == 0:
        raise ValueError(f"{path} holds no tokens.")
    largest = int(tokens.max())
    if vocab_size is not None and largest >= vocab_size:
        where = int((tokens >= vocab_size).nonzero()[0])
        raise ValueError(
            f"{path} holds token id {largest} (first out-of-range id at position {where}), not below "
            f"data.vocab_size={vocab_size}. Set data.vocab_size to the tokenizer's vocabulary size, or check the file."
        )
    return tokens, vocab_size if vocab_size is not None else largest + 1


def decode_bytes(tokens: Tensor) -> str:
    """Byte tokens → text (invalid UTF-8 replaced)."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def decode_ids(tokens: Tensor) -> str:
    """Token ids of a non-byte vocabulary, written out: ``"[464 3290 318 ...]"``."""
    return "[" + " ".join(str(int(t)) for t in tokens.tolist()) + "]"


class BlockDataset(Dataset):
    """Consecutive, non-overlapping blocks: item i is ``(x, y)`` with ``x = tokens[i·s : i·s + s]`` and
    ``y`` the same window shifted by one token. Shapes ``[s]`` each."""

    def __init__(self, tokens: Tensor, block_size: int, split: str = "corpus") -> None:
        if tokens.numel() <= block_size:
            raise ValueError(
                f"The {split} split has {tokens.numel()} tokens, which cannot fill one block of {block_size} + 1. Use a "
                f"larger corpus, a smaller block_size{', or a larger val_fraction' if split == 'validation' else ''}."
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Train/validation split of a corpus into blocks of ``block_size`` tokens.

    The training loader is torchdata's ``StatefulDataLoader``: its position is part of Lightning's
    checkpoints, so resuming mid-epoch continues with the exact next batch (with Lightning's
    ``DistributedSampler`` over the data-parallel ranks).

    Args:
        path: see :func:`load_tokens` (``None``: the built-in corpus).
        vocab_size: the tokenizer's vocabulary of a ``.bin`` corpus (see :func:`load_tokens`).
        block_size: s, tokens per sample.
        batch_size: samples per data-parallel rank and step (b).
        val_fraction: share of the corpus (its tail) held out for validation.
        num_workers: DataLoader workers.
    """

    def __init__(self, path: Optional[str] = None, block_size: int = 128, batch_size: int = 8,
                 val_fraction: float = 0.05, num_workers: int = 0, vocab_size: Optional[int] = None) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.path, self.block_size, self.batch_size = path, block_size, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.tokens, self.vocab_size = load_tokens(path, vocab_size)
        self.is_bytes = self.vocab_size == BYTE_VOCAB_SIZE and (path is None or Path(path).suffix != ".bin")

    def setup(self, stage: Optional[str] = None) -> None:
        split = int(self.tokens.numel() * (1 - self.val_fraction))
        self.train_set = BlockDataset(self.tokens[:split], self.block_size, "training")
        self.val_set = BlockDataset(self.tokens[split:], self.block_size, "validation")

    def decode(self, tokens: Tensor) -> str:
        """Text of byte tokens, or the ids written out for a token corpus."""
        return decode_bytes(tokens) if self.is_bytes else decode_ids(tokens)

    def prompt(self, text: str, max_tokens: int = 8) -> Tensor:
        """Token ids ``[n]`` to start generating from: ``text`` as bytes for a byte corpus; for a token corpus
        (no tokenizer here), the first ``max_tokens`` ids of the validation split."""
        if self.is_bytes:
            return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        split = int(self.tokens.numel() * (1 - self.val_fraction))
        return self.tokens[split : split + max_tokens].clone()

    def train_dataloader(self) -> DataLoader:
        """Shuffled blocks; a ``StatefulDataLoader``, whose position Lightning saves in checkpoints, so a run
        resumed mid-epoch continues with the exact next batch.

        Under a distributed strategy the ``DistributedSampler`` is made here, with the strategy's
        data-parallel size and rank and Lightning's seed: were Lightning to inject it, the loader's
        sampler would be a batch sampler, whose resumed position torchdata 0.11 counts in samples, not
        batches (it would skip batch_size times too far).
        """
        sampler_kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if sampler_kwargs:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # what Lightning's own sampler would use
            sampler = DistributedSampler(self.train_set, shuffle=True, seed=seed, **sampler_kwargs)
            return _stateful_loader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                                    num_workers=self.num_workers)
        return _stateful_loader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                                num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Blocks of the held-out tail, in order."""
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)


def _stateful_loader(dataset: Dataset, **kwargs: object) -> DataLoader:
    # torchdata is imported here, not with the package: only the data module needs it.
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, **kwargs)
