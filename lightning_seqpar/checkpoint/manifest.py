"""What a sharded checkpoint holds, file by file, so that it loads exactly as it was written or is refused.

Every rank records the size and CRC-32 (zlib's, at gigabytes per second) of the files it wrote; the coordinator
adds ``.metadata`` and ``trainer_state.pt`` and writes ``manifest.json`` last, with the save's id (also stored in
``trainer_state.pt``), before the directory is published. Loading checks every file against it before any
tensor reaches the model, the ranks sharing the reading; a checkpoint whose files were flipped, truncated,
deleted, taken from another save or added is refused on every rank, naming the file. A checkpoint written before
manifests existed loads with a warning.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "lightning_seqpar-manifest-1"
_CHUNK = 16 * 2**20
_ADVICE = ("Resume from the checkpoint before it (e.g. the previous step's, or the one last.ckpt replaced), or run "
           "`python -m lightning_seqpar.checkpoint verify` on it to see every damaged file.")


def file_entry(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "crc32": "8 hex digits"}`` of the file ``path``."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def _digest(manifest: dict[str, Any]) -> str:
    """CRC-32 of the manifest's content (all but its own digest), so an edit that leaves valid JSON is noticed as
    the manifest's damage instead of blamed on the file whose entry was edited."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def write_manifest(directory: Path, save_id: str, files: dict[str, dict[str, Any]]) -> None:
    """Write ``manifest.json`` into ``directory`` (the caller publishes the directory afterwards)."""
    manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "save_id": save_id, "files": dict(sorted(files.items()))}
    manifest["digest"] = _digest(manifest)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(directory: Path) -> Optional[dict[str, Any]]:
    """The manifest of ``directory``, or ``None`` when it has none (written before manifests existed).

    Raises:
        ValueError: a manifest that cannot be read, naming it.
    """
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError("unknown format")
        for name, entry in manifest["files"].items():
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get("crc32"), str):
                raise ValueError(f"bad entry for {name!r}")
        if "digest" in manifest and manifest["digest"] != _digest(manifest):  # manifests before digests have none
            raise ValueError("its content differs from what was written: edited or corrupted")
        return manifest
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"The checkpoint's manifest {path} is damaged ({error}): the checkpoint cannot be verified. "
                         f"{_ADVICE}") from error


def check_files(directory: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """What differs from ``manifest`` for each of ``names`` in ``directory`` (one line per damaged file)."""
    problems = []
    for name in names:
        want = manifest["files"][name]
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        got = file_entry(path)
        if got["size"] != want["size"]:
            problems.append(f"{path}: {got['size']} bytes, written with {want['size']} (truncated or replaced)")
        elif got["crc32"] != want["crc32"]:
            problems.append(f"{path}: content differs from what was written (CRC-32 {got['crc32']}, "
                            f"written {want['crc32']})")
    return problems


def unlisted_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Files in ``directory`` the manifest does not list (e.g. a shard copied in from another save)."""
    listed = set(manifest["files"]) | {MANIFEST_FILE}
    return sorted(f"{p}: not written by this save" for p in directory.iterdir() if p.is_file() and p.name not in listed)


def verify_checkpoint(directory: Path, rank: int = 0, world_size: int = 1) -> tuple[Optional[dict], list[str]]:
    """Check this rank's share of ``directory``'s files (file i of the sorted list on rank ``i mod world_size``)
    against its manifest. Returns ``(manifest or None, problems)``; no manifest: nothing checked.

    Raises:
        ValueError: a damaged manifest (from :func:`read_manifest`).
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return None, []
    names = sorted(manifest["files"])[rank::world_size]
    problems = check_files(directory, manifest, names)
    if rank == 0:
        problems += unlisted_files(directory, manifest)
    return manifest, problems


def verify_on_every_rank(directory: Path, group: Optional[Any] = None) -> Optional[dict]:
    """:func:`verify_checkpoint` with the files shared over the ranks of ``group`` (collective); every rank raises
    the same error when any file is damaged. Returns the manifest (``None`` for a checkpoint without one).

    Raises:
        ValueError: naming every damaged file, and what to do.
    """
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    manifest = None
    try:
        manifest, problems = verify_checkpoint(directory, rank, world)
    except ValueError as error:
        problems = [str(error)]
    save = manifest["save_id"] if manifest is not None else None
    outcomes = [(problems, save)]
    if distributed:
        outcomes = [None] * world
        dist.all_gather_object(outcomes, (problems, save), group=group)
    problems = [p for found, _ in outcomes for p in found]
    saves = sorted({str(s) for _, s in outcomes})
    if not problems and len(saves) > 1:  # a folder lock that does not hold across hosts (some network file systems)
        problems = [f"{directory} was replaced while the ranks read it (saves {', '.join(saves)}); read it again"]
    if problems:
        raise ValueError(f"The checkpoint {directory} is not what was written: " + "; ".join(problems[:8])
                         + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "") + f". {_ADVICE}")
    return manifest


def is_zip_file(path: Path) -> bool:
    """Whether ``path`` starts as a zip archive does (``torch.save``'s format since torch 1.6)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def check_zip_file(path: Path) -> None:
    """Check every member of the ``torch.save`` file ``path`` against the CRC-32 its zip directory records (torch
    writes them but does not check them when loading): the single-file checkpoint format's verification.

    Raises:
        ValueError: a member whose content differs, or a file that is not a readable zip archive (truncated,
            overwritten), naming the file.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
        raise ValueError(f"The checkpoint {path} cannot be read as written ({error}): it is truncated or damaged. "
                         f"{_ADVICE}") from error
    if damaged is not None:
        raise ValueError(f"The checkpoint {path} is not what was written: its record {damaged!r} differs from its "
                         f"CRC-32. {_ADVICE}")
