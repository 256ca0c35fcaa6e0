"""The token cache of a text corpus: tokenized once, reused by every later run and every rank.

:func:`ensure_token_cache` returns a ``.tokens`` file (:mod:`.token_file`) holding the corpus tokenized by the
given tokenizer, documents joined by its separator (the end-of-text token). It reuses the file when its header
names the same tokenizer identity, the same source files (by size and content digest, never by modification time)
and the same JSON field;
otherwise it tokenizes again (saying why) and replaces the file atomically. The cache lies beside the corpus
(``corpus.txt`` → ``corpus.txt.TOKENIZER.tokens``; a folder ``docs/`` → ``docs.TOKENIZER.tokens`` beside it), or
in ``cache_dir``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from lightning_seqpar.checkpoint.atomic import recover_stale
from lightning_seqpar.data.corpus import Piece, corpus_bytes, corpus_files, fingerprint, read_documents
from lightning_seqpar.data.progress import ByteProgress
from lightning_seqpar.data.token_file import (
    TokenFileHeader,
    TokenFileWriter,
    body_damage,
    describe_source,
    dtype_for,
    read_header,
)
from lightning_seqpar.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_BATCH = 4  # pieces (up to 32 KiB of text each, or one record) encoded together: ~2 MB of transient memory


def cache_path(corpus: Path, tokenizer: Tokenizer, cache_dir: Optional[Path] = None) -> Path:
    """Where the tokens of ``corpus`` by ``tokenizer`` are cached."""
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in tokenizer.name)[-48:] or "tokenizer"
    name = f"{corpus.resolve().name}.{slug}.tokens"
    if cache_dir is None:
        return corpus.resolve().parent / name
    where = hashlib.sha256(str(corpus.resolve()).encode()).hexdigest()[:8]  # two corpora of one name stay apart
    return Path(cache_dir) / f"{where}-{name}"


def stale_reason(path: Path, tokenizer: Tokenizer, source: list, text_field: str) -> Optional[str]:
    """Why the cache ``path`` cannot be used for this corpus and tokenizer (``None``: it can)."""
    if not path.exists():
        return "no cache yet"
    try:
        header = read_header(path)
    except ValueError as error:
        return str(error)
    if header.tokenizer_identity != tokenizer.identity:
        return (f"it was made with another tokenizer ({header.tokenizer}, identity {header.tokenizer_identity}; now "
                f"{tokenizer.name}, {tokenizer.identity})")
    if header.source != describe_source(source):
        return "the corpus files changed since it was made"
    if header.text_field != text_field:
        return f"it read JSON field '{header.text_field}', now '{text_field}'"
    damage = body_damage(path, header)  # every rank checks what it will read: a damaged cache is never used
    return None if damage is None else f"its ids are damaged: {damage}"


def ensure_token_cache(corpus: Path, tokenizer: Tokenizer, cache_dir: Optional[Path] = None,
                       text_field: str = "text", progress: bool = True) -> Path:
    """The ``.tokens`` file of ``corpus`` (a text file, a ``.jsonl`` file or a folder of them) by ``tokenizer``,
    tokenized now unless a valid cache exists. Call it on one process per node; the others
    :func:`wait_for_token_cache`.

    Raises:
        FileNotFoundError: no corpus at ``corpus``.
        ValueError: an empty corpus; a bad JSON Lines record (:func:`~.corpus.read_documents`).
        PermissionError: the cache's folder is not writable (set ``cache_dir``).
    """
    files = corpus_files(corpus)
    source = fingerprint(files)
    path = cache_path(corpus, tokenizer, cache_dir)
    if path.parent.is_dir() and os.access(path.parent, os.W_OK):
        recover_stale(path.parent)  # what tokenizations (and exports, checkpoints) killed earlier left there
    reason = stale_reason(path, tokenizer, source, text_field)
    if reason is None:
        log.info("Token cache %s is up to date: reusing it.", path)
        return path
    if reason != "no cache yet":
        log.warning("Token cache %s is rebuilt: %s.", path, reason)
    header = TokenFileHeader(dtype_for(tokenizer.vocab_size).name, tokenizer.vocab_size, tokenizer=tokenizer.name,
                             tokenizer_identity=tokenizer.identity, source=describe_source(source),
                             text_field=text_field)
    start, total = time.perf_counter(), corpus_bytes(files)
    try:
        writer = TokenFileWriter(path, header)
    except OSError as error:  # a read-only folder or file system (EACCES, EPERM, EROFS), or no space for the file
        raise PermissionError(f"Cannot write the token cache {path} ({error.strerror}): set data.cache_dir "
                              f"(TextDataModule(cache_dir=...)) to a writable folder with space.") from None
    try:
        with ByteProgress(total, f"tokenizing {corpus.name} ({tokenizer.name})", progress) as bytes_done:
            advance = lambda texts: bytes_done(sum(len(t.encode("utf-8", errors="replace")) for t in texts))
            for ids in tokenize_documents(read_documents(files, text_field), tokenizer, advance):
                writer.append(ids)
        if header.num_tokens == 0:
            raise ValueError(f"The corpus at {corpus} holds no text.")
        writer.close()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - start
    log.info("Tokenized %s: %d tokens from %.1f MB in %.1f s (%.0f tokens/s); cache %s (%.1f MB, %s).", corpus,
             header.num_tokens, total / 1e6, seconds, header.num_tokens / max(seconds, 1e-9), path,
             path.stat().st_size / 1e6, header.dtype)
    return path


def wait_for_token_cache(corpus: Path, tokenizer: Tokenizer, cache_dir: Optional[Path] = None,
                         text_field: str = "text", stall_timeout: float = 300.0, poll: float = 0.2) -> Path:
    """Wait until another process (the node's local rank 0) has made the cache :func:`ensure_token_cache` would
    return, and return it. No collective is involved, so a long tokenization trips no collective timeout, and a
    stalled or dead writer is noticed: the wait gives up when neither the cache became valid nor its writer's
    temporary file grew for ``stall_timeout`` seconds.

    Raises:
        TimeoutError: no progress for ``stall_timeout`` seconds, naming the cache.
    """
    files = corpus_files(corpus)
    source = fingerprint(files)
    path = cache_path(corpus, tokenizer, cache_dir)
    progress, last, damaged = time.monotonic(), None, None
    while True:
        try:
            stat = path.stat()
            identity: Optional[tuple] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            identity = None
        if identity is None or identity != damaged:  # a file found damaged is not read again until it is replaced
            reason = stale_reason(path, tokenizer, source, text_field)
            if reason is None:
                break
            if reason.startswith("its ids are damaged"):
                damaged = identity
        state = []
        for temporary in sorted(path.parent.glob(f".{path.name}.tmp-*")):
            try:
                state.append((temporary.name, temporary.stat().st_size))
            except FileNotFoundError:  # published or removed between the listing and the stat
                pass
        if state != last:
            progress, last = time.monotonic(), state
        elif time.monotonic() - progress > stall_timeout:
            raise TimeoutError(f"The token cache {path} was neither written nor valid after {stall_timeout:.0f} s "
                               f"without progress: the process writing it (local rank 0) stalled or died. See its log; "
                               f"delete leftover .{path.name}.tmp-* files and start again.")
        time.sleep(poll)
    return path


def tokenize_documents(pieces: Iterator[Piece], tokenizer: Tokenizer,
                       advance: Callable[[list[str]], None] = lambda texts: None) -> Iterator[np.ndarray]:
    """Ids of consecutive pieces of documents, the separator after each document, in batches of :data:`_BATCH`
    pieces (the Rust tokenizer encodes a batch on every core). A very long line is one piece."""
    separator = np.asarray(tokenizer.separator, dtype=np.int64)
    batch: list[Piece] = []

    def flush() -> np.ndarray:
        parts = []
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch])):
            parts.append(ids)
            if piece.ends_document:
                parts.append(separator)
        advance([p.text for p in batch])
        batch.clear()
        return np.concatenate(parts)

    for piece in pieces:
        batch.append(piece)
        if len(batch) == _BATCH:
            yield flush()
    if batch:
        yield flush()
