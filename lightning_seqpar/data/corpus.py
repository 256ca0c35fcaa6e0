"""Where text comes from: the built-in corpus, text files, folders and JSON Lines, read as a stream of documents.

A document is one text file or one JSON Lines record. Text files are read in pieces of whole lines (about
32 KiB each), so a multi-GB file is never held in memory; Hugging Face's ``run_clm`` example tokenizes text files
line by line in the same spirit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from lightning_seqpar.checkpoint.content import content_digest

JSONL_SUFFIXES = (".jsonl",)
TOKEN_SUFFIXES = (".bin", ".tokens")
_PIECE_BYTES = 2**15


def builtin_corpus() -> str:
    """The Python reference documentation that ships with every CPython (``pydoc_data.topics``, ~465 kB).

    Real English-and-code text that needs no download.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclass(frozen=True)
class Piece:
    """Text of one document (all of it, or a run of whole lines) and whether the document ends with it."""

    text: str
    ends_document: bool


def corpus_files(path: Path) -> list[Path]:
    """The files a corpus path stands for: the file itself, or a folder's files in sorted order (hidden files
    and token files left out, so a cache written beside them is never read as text).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a folder without a readable file.
    """
    if not path.exists():
        raise FileNotFoundError(f"No corpus at {path}.")
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                   p.relative_to(path).parts) and p.suffix not in TOKEN_SUFFIXES)
    if not files:
        raise ValueError(f"The folder {path} holds no text or JSON Lines file.")
    return files


def fingerprint(files: list[Path]) -> list[list]:
    """``[name, bytes, SHA-256 of the content]`` of each file: a cache made from these files is valid while this is
    unchanged (:func:`~lightning_seqpar.checkpoint.content.content_digest`; never size and time alone)."""
    return [[str(p.resolve()), p.stat().st_size, content_digest(p)] for p in files]


def read_documents(files: list[Path], text_field: str = "text") -> Iterator[Piece]:
    """Every document of ``files`` as :class:`Piece` s, in order. Text is read as UTF-8 (invalid bytes become
    U+FFFD); a ``.jsonl`` file gives one document per line, the string under ``text_field``.

    Raises:
        ValueError: a JSON Lines record that is not an object with a string under ``text_field``, naming the
            file, the line and the fields it has.
    """
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field)
        else:
            yield from _text_pieces(path)


def _text_pieces(path: Path) -> Iterator[Piece]:
    with open(path, encoding="utf-8", errors="replace", newline="") as file:
        pending: Optional[str] = None
        while True:
            lines = file.readlines(_PIECE_BYTES)  # whole lines, about _PIECE_BYTES in all
            if pending is not None:
                yield Piece(pending, ends_document=not lines)
            if not lines:
                return
            pending = "".join(lines)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Piece]:
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not JSON ({error.msg}): a .jsonl corpus holds one JSON object "
                                 f"per line.") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{number} has no string field '{text_field}' (it has {fields}); name the "
                                 f"field with data.text_field (TextDataModule(text_field=...)).")
            yield Piece(text, ends_document=True)


def corpus_bytes(files: list[Path]) -> int:
    """Bytes of text in ``files`` (for progress)."""
    return sum(os.path.getsize(p) for p in files)
