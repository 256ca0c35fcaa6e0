"""Safetensors files written one tensor at a time, in pieces, so no writer holds more than the tensor it writes.

The ``safetensors`` package writes a file from a dict of whole tensors; a model larger than a host cannot be
handed to it at once. The format is simple enough to stream (https://huggingface.co/docs/safetensors: an
8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}`` padded with
spaces, then the raw little-endian bytes in header order), so the header is written from the plan and each
tensor's bytes follow as they arrive. Reading is left to ``safetensors`` (and ``from_pretrained``).
Hugging Face's layout of several files: ``model-00001-of-00003.safetensors`` ... and
``model.safetensors.index.json`` mapping each tensor to its file; one file is ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from lightning_seqpar.hf.weights import INDEX_FILE

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an export: its name in the file, dtype and single-device shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes in the file."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def check_storable(entries: Iterable[TensorEntry]) -> None:
    """Raise ``ValueError`` naming the first tensor whose dtype safetensors has no name for."""
    for entry in entries:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"'{entry.name}' is {entry.dtype}, which safetensors cannot store; export it in another "
                             f"dtype (dtype=torch.bfloat16, torch.float32, ...).")


def split_into_files(groups: Sequence[Sequence[TensorEntry]], max_file_bytes: int) -> list[list[TensorEntry]]:
    """Cut each group (e.g. the tensors of one pipeline stage, whose writer is one rank) into files of at most
    ``max_file_bytes`` (a tensor larger than that gets a file of its own), in order; groups never share a file."""
    files: list[list[TensorEntry]] = []
    for group in groups:
        current: list[TensorEntry] = []
        size = 0
        for entry in group:
            if current and size + entry.nbytes > max_file_bytes:
                files.append(current)
                current, size = [], 0
            current.append(entry)
            size += entry.nbytes
        if current:
            files.append(current)
    return files


def file_names(count: int) -> list[str]:
    """Hugging Face's names for ``count`` weight files."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class SafetensorsStreamWriter:
    """Writes the safetensors file ``path`` holding ``entries``, in that order, each tensor from pieces.

    Use as a context manager; :meth:`write` each entry in order (a tensor, or its bytes in order as several
    tensors: :meth:`write_pieces`). Closing checks that every entry was written in full.

    Raises:
        ValueError: a dtype safetensors has no name for; a tensor written out of order or of another size.
    """

    def __init__(self, path: os.PathLike | str, entries: Sequence[TensorEntry],
                 metadata: Optional[dict[str, str]] = None) -> None:
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        check_storable(entries)
        offset = 0
        for entry in entries:
            header[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self._entries, self._next, self._written = list(entries), 0, 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(check=exc[0] is None)

    def write(self, name: str, tensor: Tensor) -> None:
        """Write the whole tensor ``name`` (cast to the entry's dtype)."""
        self.write_pieces(name, [tensor])

    def write_pieces(self, name: str, pieces: Iterable[Tensor]) -> None:
        """Write tensor ``name`` from ``pieces``: consecutive parts of its row-major bytes (e.g. blocks of rows),
        each cast to the entry's dtype as it is written."""
        if self._next >= len(self._entries) or self._entries[self._next].name != name:
            expected = self._entries[self._next].name if self._next < len(self._entries) else "nothing"
            raise ValueError(f"Safetensors stream: '{name}' written where '{expected}' comes next.")
        entry = self._entries[self._next]
        written = 0
        for piece in pieces:
            data = piece.detach().to("cpu", entry.dtype).contiguous().reshape(-1).view(torch.uint8)
            self._file.write(memoryview(data.numpy()))
            written += data.numel()
        if written != entry.nbytes:
            raise ValueError(f"Safetensors stream: '{name}' got {written} bytes, its entry holds {entry.nbytes}.")
        self._next += 1

    def close(self, check: bool = True) -> None:
        """Close the file; with ``check``, raise ``ValueError`` unless every entry was written."""
        self._file.close()
        if check and self._next != len(self._entries):
            raise ValueError(f"Safetensors stream closed after {self._next} of {len(self._entries)} tensors.")


def write_index(directory: os.PathLike | str, files: Sequence[Sequence[TensorEntry]]) -> None:
    """``model.safetensors.index.json`` for ``files`` (named by :func:`file_names`); nothing for one file."""
    if len(files) < 2:
        return
    names = file_names(len(files))
    index = {"metadata": {"total_size": sum(e.nbytes for file in files for e in file)},
             "weight_map": {entry.name: names[i] for i, file in enumerate(files) for entry in file}}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.json",
                   "chat_template.jinja", "spiece.model")


def copy_companion_files(source: os.PathLike | str, directory: os.PathLike | str) -> list[str]:
    """Copy the tokenizer and generation files of the model directory ``source`` into ``directory`` (weights and
    ``config.json`` are written from the trained model instead). Returns the names copied."""
    source = Path(source)
    copied = []
    for name in COMPANION_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, Path(directory) / name)
            copied.append(name)
    return copied


def finish_directory(directory: os.PathLike | str, files: Sequence[Sequence[TensorEntry]], config: object,
                     source: Optional[os.PathLike | str] = None, tokenizer: object = None) -> None:
    """Complete an exported model directory whose weight files are written: the index, ``config.json``, the
    tokenizer and generation files of the model directory ``source`` (if it is one), then ``tokenizer``'s own files
    (``save_pretrained``), which replace the copied tokenizer's."""
    write_index(directory, files)
    config.save_pretrained(str(directory))  # type: ignore[attr-defined]
    if source is not None and Path(source).is_dir():
        copy_companion_files(source, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))  # type: ignore[attr-defined]
