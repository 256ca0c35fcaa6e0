"""Token files: a cache of a tokenized corpus (``.tokens``, with a header) and nanoGPT's headerless ``.bin``.

A ``.tokens`` file is ``LSPTOKS1``, an 8-byte little-endian header length, a JSON header padded to
:data:`DATA_OFFSET` bytes, then the ids as little-endian ``uint8``, ``uint16`` or ``uint32`` (the narrowest that holds
the vocabulary). The header records the dtype, the vocabulary size, the number of tokens, the largest id, the
tokenizer (name and identity), the source files' sizes and SHA-256 digests, and a CRC-32 of each 16 MiB block of
the ids, so a file is never read with the wrong dtype, taken for the tokens of another tokenizer or corpus, or read
with damaged ids (:func:`body_damage`). Files are opened memory-mapped: every rank
maps the same pages of the page cache instead of holding its own copy. Written under a temporary name and renamed
when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from lightning_seqpar.checkpoint.atomic import publish, temporary_path

MAGIC = b"LSPTOKS1"
DATA_OFFSET = 4096
_SCAN = 2**24  # ids per chunk when scanning a file for its largest id
BLOCK_BYTES = 2**24
"""Bytes of ids per CRC-32 the header records."""


def dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest that holds every id: ``uint8`` for bytes, ``uint16`` up to 65 536 ids, ``uint32`` above."""
    return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass
class TokenFileHeader:
    """What a ``.tokens`` file holds and how it was made."""

    dtype: str
    vocab_size: int
    num_tokens: int = 0
    max_id: int = -1
    tokenizer: str = ""           # the tokenizer's name (a directory name, or "bytes")
    tokenizer_identity: str = ""  # hash of what decides its ids (lightning_seqpar.data.tokenizer)
    source: dict = field(default_factory=dict)  # {"files": n, "digest": ...} of the corpus (describe_source)
    text_field: Optional[str] = None
    block_bytes: int = 0  # bytes of ids per entry of block_crc32 (0: written before bodies were checked)
    block_crc32: list = field(default_factory=list)

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self)).encode()
        return MAGIC + struct.pack("<Q", len(body)) + body.ljust(DATA_OFFSET - 16, b" ")


def describe_source(fingerprint: list) -> dict:
    """How a header records the corpus files' ``[name, bytes, content SHA-256]`` list
    (:func:`~lightning_seqpar.data.corpus.fingerprint`): their number and a digest (any number of files fits the
    header)."""
    return {"files": len(fingerprint), "digest": hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest()}


class TokenFileWriter:
    """Appends ids to a new ``.tokens`` file; :meth:`close` writes the header and publishes it atomically."""

    def __init__(self, path: Path, header: TokenFileHeader) -> None:
        self.path, self.header = path, header
        self.dtype = np.dtype(header.dtype)
        self.tmp = temporary_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        self.file.write(b"\0" * DATA_OFFSET)
        self.header.block_bytes, self.header.block_crc32 = BLOCK_BYTES, []
        self._crc, self._filled = 0, 0  # of the block being written

    def append(self, ids: np.ndarray) -> None:
        """Add ``ids`` (any integer dtype) at the end.

        Raises:
            ValueError: an id at or above the vocabulary size.
        """
        if ids.size == 0:
            return
        largest = int(ids.max())
        if largest >= self.header.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"The tokenizer {self.header.tokenizer} produced id {largest}, outside its vocabulary of "
                             f"{self.header.vocab_size}.")
        self.header.max_id = max(self.header.max_id, largest)
        self.header.num_tokens += int(ids.size)
        data = ids.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        try:
            self.file.write(data)
        except OSError as error:
            raise self._named(error) from error
        view = memoryview(data)
        while view:
            take = min(len(view), BLOCK_BYTES - self._filled)
            self._crc, self._filled = zlib.crc32(view[:take], self._crc), self._filled + take
            view = view[take:]
            if self._filled == BLOCK_BYTES:
                self.header.block_crc32.append(self._crc)
                self._crc, self._filled = 0, 0

    def close(self) -> Path:
        if self._filled:
            self.header.block_crc32.append(self._crc)
        try:
            self.file.seek(0)
            self.file.write(self.header.to_bytes())
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        except OSError as error:
            raise self._named(error) from error
        publish(self.tmp, self.path)
        return self.path

    def _named(self, error: OSError) -> OSError:
        """A write error (a full disk names no path of its own) with the cache's path and the fix."""
        return OSError(error.errno, f"Writing the token cache {self.tmp} failed ({error.strerror}): free space there, "
                                    f"or set data.cache_dir to another folder")

    def abort(self) -> None:
        try:
            self.file.close()
        except OSError:  # the buffered bytes of a full disk: the file is deleted anyway
            pass
        self.tmp.unlink(missing_ok=True)


def is_token_file(path: Path) -> bool:
    """Whether ``path`` starts with the ``.tokens`` magic."""
    try:
        with open(path, "rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: Path) -> TokenFileHeader:
    """The header of the ``.tokens`` file ``path``.

    Raises:
        ValueError: not a token file, or one whose size disagrees with its header (truncated), naming it.
    """
    with open(path, "rb") as file:
        start = file.read(16)
        if len(start) < 16 or start[:8] != MAGIC:
            raise ValueError(f"{path} is not a .tokens file (no {MAGIC!r} header); a headerless file of uint16 ids "
                             f"(nanoGPT's format) is named .bin.")
        (length,) = struct.unpack("<Q", start[8:])
        try:
            header = TokenFileHeader(**json.loads(file.read(length)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path} has a damaged header ({error}); delete it to rebuild the cache.") from None
    expected = DATA_OFFSET + header.num_tokens * np.dtype(header.dtype).itemsize
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path} holds {size} bytes, but its header describes {header.num_tokens} {header.dtype} ids "
                         f"({expected} bytes): it is damaged or truncated; delete it to rebuild the cache.")
    return header


def body_damage(path: Path, header: TokenFileHeader) -> Optional[str]:
    """What is wrong with the ids of the ``.tokens`` file ``path`` (``None``: they are as written): a block whose
    CRC-32 differs from the header's, or a largest id other than the header's. Reads the body once, block by block
    (CRC-32 and the largest id: about 5 GB/s on this 2-core machine), memory-mapped.
    """
    if not header.block_bytes:
        return "it records no checksum of its ids (written by an earlier version), so its ids cannot be checked"
    body = np.memmap(path, dtype=np.uint8, mode="r", offset=DATA_OFFSET) if header.num_tokens else np.zeros(0, np.uint8)
    dtype = np.dtype(header.dtype).newbyteorder("<")
    blocks = range(0, body.shape[0], header.block_bytes)
    if len(blocks) != len(header.block_crc32):
        return f"it has {len(blocks)} blocks of ids, its header {len(header.block_crc32)} checksums"
    largest = -1
    for index, start in enumerate(blocks):
        block = body[start:start + header.block_bytes]
        if zlib.crc32(block) != header.block_crc32[index]:
            return f"bytes {DATA_OFFSET + start}..{DATA_OFFSET + start + block.shape[0]} differ from what was written"
        largest = max(largest, int(block.view(dtype).max()))
    if largest != header.max_id:
        return f"its largest id is {largest}, its header says {header.max_id}"
    return None


def open_tokens(path: Path) -> tuple[TokenFileHeader, np.ndarray]:
    """The header and the ids ``[n]`` of a ``.tokens`` file, memory-mapped read-only."""
    header = read_header(path)
    ids = np.memmap(path, dtype=np.dtype(header.dtype).newbyteorder("<"), mode="r", offset=DATA_OFFSET,
                    shape=(header.num_tokens,))
    return header, ids


def open_bin(path: Path, dtype: str = "uint16") -> np.ndarray:
    """The ids ``[n]`` of a headerless token file (nanoGPT's ``.bin``: ``uint16``; ``uint32`` when stated), mapped.

    Raises:
        ValueError: a dtype other than uint16/uint32; a size that is not a whole number of ids; no ids.
    """
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"data.token_dtype={dtype!r}: a .bin file holds 'uint16' (nanoGPT) or 'uint32' ids.")
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % item:
        raise ValueError(f"{path} holds {size} bytes, not a multiple of {item}: a .bin corpus is a flat array of "
                         f"{dtype} token ids ({item} bytes each). The file is truncated or not a token file.")
    if size == 0:
        raise ValueError(f"{path} holds no tokens.")
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(size // item,))


def largest_id(ids: np.ndarray) -> int:
    """The largest id of ``ids``, read in chunks, so a mapped file is scanned without an in-memory copy."""
    return max(int(ids[start:start + _SCAN].max()) for start in range(0, ids.shape[0], _SCAN))


def first_at_or_above(ids: np.ndarray, limit: int) -> int:
    """The position of the first id ``>= limit`` (-1: none), read in chunks."""
    for start in range(0, ids.shape[0], _SCAN):
        hits = np.flatnonzero(ids[start:start + _SCAN] >= limit)
        if hits.size:
            return start + int(hits[0])
    return -1
