"""The rendered fine-tuning set on disk: written in one streaming pass, verified by digest, waited for by progress.

A JSON Lines file is read line by line and rendered :data:`RECORDS_PER_BATCH` records at a time
(:func:`~lightning_seqpar.data.supervised.render_records`: one template call and one fast-tokenizer call per batch),
each batch's arrays appended to the cache's section files as it is made, so preparing a file takes memory bounded by
a batch, whatever the file's size. The cache is a directory ``FILE.sft-<key>/`` published atomically:

- ``ids.bin`` (``int32`` ids, every example's tokens one after the other), ``supervised.bin`` (``uint8``: the loss is
  taken on token i's prediction), ``lengths.bin`` (``int64`` tokens per example), ``predicted.bin`` (``int64``
  supervised tokens per example but its first, whose label is never predicted: what a row's count sums, so no rank
  reads the flags to count);
- ``meta.json``: the version, the source file (path, bytes, SHA-256 of its content), the tokenizer's identity, the chat
  template's hash, the counts and the largest id (so no rank reads the ids to check them against the model), and each
  section's byte size and SHA-256.

Every rank verifies the digests before it reads (one read of about 5 bytes per token); a damaged cache is rebuilt with
a warning when it was made from a source, and refused by name when it is the data path itself. A rank that waits
for local rank 0's cache gives up only when the temporary directory has not grown for ``stall_timeout`` seconds.

Raises (:func:`read_records`): ``ValueError`` naming the file and line for bytes that are not UTF-8 and for malformed
JSON (json's own column inside the line).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from lightning_seqpar.checkpoint.atomic import file_digest, publish, recover_stale, temporary_path
from lightning_seqpar.data.progress import ByteProgress
from lightning_seqpar.data.supervised import SupervisedExample, render_records

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 3: predicted.bin and max_id (rows counted and ids checked without reading the tokens)
RECORDS_PER_BATCH = 256
SECTIONS = {"ids": np.int32, "supervised": np.uint8, "lengths": np.int64, "predicted": np.int64}


def read_records(path: Path) -> Iterator[tuple[int, int, Any]]:
    """``(line number, bytes read so far, record)`` for each non-blank line of the JSON Lines file ``path``.

    Raises:
        ValueError: a line that is not UTF-8 or not JSON, naming the file, the line and the fix.
    """
    done = 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: byte {error.start + 1} of the line is not UTF-8 "
                                 f"({raw[error.start:error.start + 1]!r}); save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # a column counted within the line
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg} at column {error.pos + 1}); each line must "
                                 f"be one JSON object.") from None
            yield number, done, record


@dataclass(frozen=True)
class SupervisedCache:
    """An opened cache: its ``meta`` and its sections (read-only memory maps)."""

    path: Path
    meta: dict
    ids: np.ndarray
    supervised: np.ndarray
    lengths: np.ndarray
    predicted: np.ndarray

    def examples(self) -> list[SupervisedExample]:
        """Every example, as views of the memory maps (``int32`` ids, ``bool`` flags): nothing is read until used."""
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        flags = self.supervised.view(bool)
        return [SupervisedExample(self.ids[a:b], flags[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def is_cache(path: Path) -> bool:
    """Whether ``path`` is a cache directory (it holds ``meta.json`` naming this format)."""
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == "lightning_seqpar.sft"
    except (OSError, ValueError, AttributeError):
        return False


def damage(path: Path) -> Optional[str]:
    """Why the cache directory ``path`` cannot be read (``None``: it is whole)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as error:
        return f"its meta.json cannot be read ({error})"
    if meta.get("version") != CACHE_VERSION:
        return f"it is of version {meta.get('version')}, this release reads {CACHE_VERSION}"
    for name in SECTIONS:
        section, want = path / f"{name}.bin", meta.get("sections", {}).get(name, {})
        if not section.is_file() or section.stat().st_size != want.get("bytes"):
            return f"{section.name} is missing or of another size than recorded"
        if file_digest(section) != want.get("sha256"):
            return f"{section.name} does not match its recorded SHA-256"
    return None


def open_cache(path: Path, verified: bool = False) -> SupervisedCache:
    """The cache at ``path``, verified by its digests unless the caller has just done so (``verified``: a second read
    of every section would double the cost).

    Raises:
        ValueError: a damaged cache, naming it and what is wrong.
    """
    why = None if verified else damage(path)
    if why is not None:
        raise ValueError(f"The fine-tuning cache {path} is damaged: {why}. Prepare it again from its .jsonl file.")
    meta = json.loads((path / "meta.json").read_text())
    sections = {name: np.memmap(path / f"{name}.bin", dtype=dtype, mode="r") if meta["sections"][name]["bytes"]
                else np.zeros(0, dtype) for name, dtype in SECTIONS.items()}
    return SupervisedCache(path, meta, **sections)


class _Sections:
    """The section files being written, with their running digests."""

    def __init__(self, folder: Path) -> None:
        self.files = {name: open(folder / f"{name}.bin", "wb") for name in SECTIONS}
        self.digests = {name: hashlib.sha256() for name in SECTIONS}
        self.bytes = dict.fromkeys(SECTIONS, 0)

    def append(self, name: str, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=np.dtype(SECTIONS[name]).newbyteorder("<")).tobytes()
        try:
            self.files[name].write(data)
        except OSError as error:  # a full disk names no path of its own
            raise OSError(error.errno, f"Writing the fine-tuning cache {self.files[name].name} failed "
                                       f"({error.strerror}): free space there, or set data.cache_dir to another "
                                       f"folder") from None
        self.digests[name].update(data)
        self.bytes[name] += len(data)

    def close(self) -> dict:
        for handle in self.files.values():
            handle.flush()
            handle.close()
        return {name: {"bytes": self.bytes[name], "sha256": self.digests[name].hexdigest()} for name in SECTIONS}


def write_cache(source: Path, tokenizer: Any, out: Path, identity: dict, progress: bool = True) -> None:
    """Render ``source`` into the cache directory ``out`` (see the module docstring) and publish it.

    Raises:
        ValueError: from :func:`read_records` and the rendering, naming the line; an id outside the tokenizer's
            vocabulary.
        PermissionError: the cache's folder is not writable, with the fix (``data.cache_dir``).
    """
    tmp = temporary_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        recover_stale(out.parent)  # what a preparation killed earlier left there
        tmp.mkdir()
    except OSError as error:  # a read-only folder (EACCES, EROFS) or a full disk names no fix of its own
        raise PermissionError(f"Cannot write the fine-tuning cache {out} ({error.strerror}): set data.cache_dir to a "
                              f"writable folder with space.") from None
    try:
        sections = _Sections(tmp)
        counts = {"examples": 0, "tokens": 0, "supervised": 0, "max_id": -1}
        total = source.stat().st_size
        with ByteProgress(total, f"preparing {source.name}", progress) as advance:
            batch: list[tuple[int, Any]] = []
            done = 0

            def flush() -> None:
                wheres = [f"{source}:{number}" for number, _ in batch]
                examples = render_records([record for _, record in batch], tokenizer, wheres)
                for example, where in zip(examples, wheres):
                    if len(example) and (int(example.ids.max()) >= 2 ** 31 or int(example.ids.min()) < 0):
                        raise ValueError(f"{where}: the tokenizer produced id {int(example.ids.max())}, outside int32.")
                sections.append("ids", np.concatenate([e.ids for e in examples]))
                sections.append("supervised", np.concatenate([e.supervised for e in examples]))
                sections.append("lengths", np.asarray([len(e) for e in examples]))
                sections.append("predicted", np.asarray([int(e.supervised[1:].sum()) for e in examples]))
                counts["max_id"] = max([counts["max_id"], *(int(e.ids.max()) for e in examples if len(e))])
                counts["examples"] += len(examples)
                counts["tokens"] += sum(len(e) for e in examples)
                counts["supervised"] += sum(int(e.supervised.sum()) for e in examples)
                batch.clear()

            for number, read, record in read_records(source):
                batch.append((number, record))
                if len(batch) == RECORDS_PER_BATCH:
                    flush()
                    advance(read - done)
                    done = read
            if batch:
                flush()
            advance(total - done)
        if counts["examples"] == 0:
            raise ValueError(f"{source} holds no records.")
        meta = {"format": "lightning_seqpar.sft", "version": CACHE_VERSION, **identity, **counts,
                "sections": sections.close()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def wait_for_cache(out: Path, fresh: Any, stall_timeout: float, poll: float = 0.2) -> None:
    """Wait until ``fresh(out)`` holds (the node's local rank 0 writes the cache), giving up only when no temporary
    directory of ``out`` has grown for ``stall_timeout`` seconds.

    Raises:
        TimeoutError: no progress for ``stall_timeout`` seconds, naming the cache.
    """
    progress, last = time.monotonic(), None
    while not fresh(out):
        state = []
        for temporary in sorted(out.parent.glob(f".{out.name}.tmp-*")):
            try:
                state.append((temporary.name, sum(p.stat().st_size for p in temporary.iterdir())))
            except FileNotFoundError:  # published or removed while listed
                pass
        if state != last:
            progress, last = time.monotonic(), state
        elif time.monotonic() - progress > stall_timeout:
            raise TimeoutError(f"The fine-tuning cache {out} was neither written nor valid after {stall_timeout:.0f} s "
                               f"without progress: local rank 0, which prepares it, stalled or died. See its log.")
        time.sleep(poll)
