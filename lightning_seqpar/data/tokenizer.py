"""The tokenizers a corpus is read with: UTF-8 bytes, or a Hugging Face tokenizer (a model directory's own,
:mod:`lightning_seqpar.hf.tokenizer`).

Both give token ids for text, text for ids, the ids placed between documents, the vocabulary size, and an
identity: a hash of everything that decides the ids, so a token cache made with another tokenizer is never
read as if made with this one. ``transformers`` is imported only for a Hugging Face tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np

from lightning_seqpar.hf.tokenizer import TOKENIZER_FILES, load_hf_tokenizer

BYTE_VOCAB_SIZE = 256
BYTES = "bytes"


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer: ``name`` (for file names and messages), ``identity`` (changes
    whenever the ids it gives could), ``vocab_size`` (ids are below it), ``separator`` (ids put after each
    document), and batch encoding / decoding."""

    name: str
    identity: str
    vocab_size: int
    separator: list[int]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text (no special tokens), int64 arrays."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Text as its UTF-8 bytes (vocabulary 256); documents are separated by a blank line (``\\n\\n``)."""

    name = BYTES
    identity = "bytes-utf8"
    vocab_size = BYTE_VOCAB_SIZE
    separator = [10, 10]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid UTF-8, and ids a model larger than 256 tokens may sample, become U+FFFD."""
        return bytes(i if 0 <= i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


def has_tokenizer(directory: Optional[str]) -> bool:
    """Whether the model directory ``directory`` holds a tokenizer."""
    return directory is not None and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``: :class:`ByteTokenizer`; a directory (or a name ``AutoTokenizer`` resolves): :class:`HFTokenizer`.

    Raises:
        ImportError: a Hugging Face tokenizer without ``transformers``, with the install command.
        ValueError: a directory that holds no tokenizer, naming what it holds.
        FileNotFoundError: a local path that does not exist.
    """
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists() and (spec.startswith(("/", ".", "~")) or path.parent.is_dir() and str(path.parent) != "."):
        raise FileNotFoundError(f"No tokenizer at {spec}: the directory does not exist (a model directory's tokenizer "
                                f"is read from it; nothing is downloaded). Check the path (model.pretrained, "
                                f"data.tokenizer).")
    if path.is_dir() and not has_tokenizer(spec):
        raise ValueError(f"{spec} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}; it has "
                         f"{sorted(p.name for p in path.iterdir())[:12]}). Name a tokenizer directory with "
                         f"data.tokenizer=DIR, or data.tokenizer=bytes to train on UTF-8 bytes.")
    return load_hf_tokenizer(spec, name=path.name if path.is_dir() else spec)
