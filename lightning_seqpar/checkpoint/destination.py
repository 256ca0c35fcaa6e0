"""Where an export may write: never over anything it did not write.

An export (``export_hf``, ``export-hf``) publishes a whole directory under its name, replacing what is there. So
before anything is written, the destination must be absent, an empty directory, or a previous export (recognized by
the marker file every export writes, and replaced only when asked: ``overwrite``). The marker lists the files the
export wrote; a previous export holding any other file (one the user put there since) is refused even with
``overwrite``, naming the files. A folder of the user's files, a regular file, the run folder (checkpoints, logs) and the model directory the run started from are refused by name;
the last two even with ``overwrite``. ``consolidate`` writes one file and refuses to replace an existing one unless
asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from lightning_seqpar.checkpoint.atomic import file_digest

EXPORT_MARKER = ".lightning_seqpar_export"
"""Written into every exported directory: ``--overwrite`` replaces only a directory holding it."""
_SHOWN = 6


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def export_refusal(out: os.PathLike | str, *, overwrite: bool = False,
                   protected: Iterable[Optional[os.PathLike | str]] = ()) -> Optional[str]:
    """Why the directory ``out`` must not be written by an export (``None``: it may).

    ``protected``: folders an export must neither replace nor contain (the run folder, its checkpoints and logs, the
    source model directory, the checkpoint exported from).
    """
    target = Path(out).absolute().resolve()
    for folder in filter(None, protected):
        kept = Path(folder).absolute().resolve()
        if _inside(kept, target):
            what = "" if kept == target else f" holds {kept}, which"
            return (f"The export destination {out}{what} must be kept (a run folder, its checkpoints or logs, the "
                    f"checkpoint exported, or the model directory the run started from): an export replaces its whole "
                    f"destination. Export to a new directory.")
    if not target.exists():
        return None
    if not target.is_dir():
        return f"The export destination {out} is a file: an export writes a directory. Name a new directory."
    held = sorted(p.name for p in target.iterdir())
    if not held:
        return None
    if EXPORT_MARKER in held:
        added = _not_exported(target)
        if added:
            shown = ", ".join(added[:_SHOWN]) + (f" and {len(added) - _SHOWN} more" if len(added) > _SHOWN else "")
            return (f"The export destination {out} holds a previous export and files it did not write ({shown}): "
                    f"replacing it would delete them. Move them out of {out}, or export to a new directory.")
        return None if overwrite else (
            f"The export destination {out} holds a previous export. Pass --overwrite (export_hf_overwrite=true in the "
            f"recipe, overwrite=True in save_hf_pretrained) to replace it, or export to a new directory.")
    shown = ", ".join(held[:_SHOWN]) + (f" and {len(held) - _SHOWN} more" if len(held) > _SHOWN else "")
    return (f"The export destination {out} is a directory that holds files no export wrote ({shown}): an export "
            f"replaces its whole destination, so they would be deleted. Export to a new or empty directory.")


def refuse_export_destination(out: os.PathLike | str, *, overwrite: bool = False,
                              protected: Iterable[Optional[os.PathLike | str]] = ()) -> None:
    """Raise :func:`export_refusal`'s reason.

    Raises:
        FileExistsError: naming the destination, what it holds and the fix.
    """
    reason = export_refusal(out, overwrite=overwrite, protected=protected)
    if reason is not None:
        raise FileExistsError(reason)


def _files(directory: Path) -> list[str]:
    """Every file and link under ``directory`` (but the marker), relative, ``/``-separated."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if not p.is_dir() or p.is_symlink()) if directory.is_dir() else []


def _not_exported(directory: Path) -> list[str]:
    """The files of a marked ``directory`` its export did not write (all of them when the marker lists none)."""
    try:
        written = set(json.loads((directory / EXPORT_MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or a marker older than its file list
        written = set()
    return [name for name in _files(directory) if name != EXPORT_MARKER and name not in written]


def mark_export(directory: os.PathLike | str, source: str, digests: bool = False) -> None:
    """Write the marker of an exported directory, listing the files written (after them, before it is published);
    ``digests``: with each file's SHA-256 too, verified when the directory is read back (small exports: adapters)."""
    files = [name for name in _files(Path(directory)) if name != EXPORT_MARKER]
    record: dict = {"written_by": "lightning_seqpar", "from": source, "files": files}
    if digests:
        record["sha256"] = {name: file_digest(Path(directory) / name) for name in files}
    (Path(directory) / EXPORT_MARKER).write_text(json.dumps(record) + "\n")


def refuse_existing_file(out: os.PathLike | str, overwrite: bool) -> None:
    """Refuse to replace an existing file (or any directory) at ``out`` unless ``overwrite``.

    Raises:
        FileExistsError: naming it and the fix.
    """
    path = Path(out)
    if path.is_dir():
        raise FileExistsError(f"{out} is a directory: consolidate writes one file. Name a new file.")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{out} exists. Pass --overwrite to replace it, or name a new file.")
