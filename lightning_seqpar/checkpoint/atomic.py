"""Publishing a checkpoint (a file or a directory) atomically under its final name.

A checkpoint is written under a hidden temporary name in the target folder (``.NAME.tmp-ID``) and
renamed to ``NAME`` only when complete, so a reader never sees a partial one. Replacing an existing
``NAME`` (e.g. ``last.ckpt``) moves it aside to ``.NAME.old-ID`` first; a writer killed between the
two renames leaves the previous checkpoint there, and :func:`recover_stale` puts it back. Removing one
renames it to ``.NAME.del-ID`` before deleting its files, so a removal killed halfway never leaves a
partial checkpoint under its name. POSIX ``rename`` is atomic for files and directories alike.

Publishing and removing take an exclusive lock on the folder (``flock`` on the directory itself: no lock file), and
readers of a checkpoint hold a shared one while they read it (:func:`folder_lock`), so a reader never sees half of one
save and half of the next, and two writers into one folder take turns instead of racing between their renames.

``ID`` is the writer's identity, ``PID-START`` (its process id and the clock tick it started at, from
``/proc``): a process that reuses the PID of a writer killed earlier (after a restart) has another start
time, so what the dead writer left is still recovered. A bare ``PID`` (older checkpoints, systems without
``/proc``) is taken as alive while that PID is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
DELETE_MARK = ".del-"


def _start_tick(pid: int) -> str | None:
    """The clock tick process ``pid`` started at (``/proc/PID/stat`` field 22), ``None`` if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def writer_identity(pid: int | None = None) -> str:
    """``PID-START`` of process ``pid`` (default this one), or ``PID`` where the start time is unknown."""
    pid = os.getpid() if pid is None else pid
    start = _start_tick(pid)
    return f"{pid}-{start}" if start is not None else str(pid)


def temporary_path(path: Path, writer: int | str | None = None) -> Path:
    """Where ``path`` is written before it is published: ``.NAME.tmp-ID`` beside it (``writer``: the writer's
    identity, default this process's; a multi-process writer passes its coordinator's so every rank agrees)."""
    return path.with_name(f".{path.name}{TMP_MARK}{writer_identity() if writer is None else writer}")


def _writer_alive(identity: str) -> bool:
    pid_text, _, start = identity.partition("-")
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a killed process not yet reaped by its parent is a zombie: it writes nothing more
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    if start and _start_tick(pid) not in (None, start):
        return False  # the PID now belongs to another process: the writer is gone
    return pid != os.getpid()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def other_live_writers(directory: Path, own: str) -> list[str]:
    """Identities of live processes other than ``own`` writing into ``directory`` now (from their temporaries)."""
    found = set()
    for path in directory.glob(f".*{TMP_MARK}*"):
        identity = path.name.rpartition(TMP_MARK)[2]
        if identity != own and identity.replace("-", "", 1).isdigit() and _writer_alive(identity):
            found.add(identity)
    return sorted(found)


def recover_stale(directory: Path) -> list[Path]:
    """Clean up after writers killed mid-save in ``directory``; those still running are left alone.

    A dead writer's temporary (``.NAME.tmp-ID``) is deleted. Its moved-aside previous checkpoint
    (``.NAME.old-ID``) is renamed back to ``NAME`` if nothing was published there, and deleted
    otherwise. Returns the paths removed or restored.
    """
    touched = []
    for mark in (OLD_MARK, TMP_MARK, DELETE_MARK):
        for path in sorted(directory.glob(f".*{mark}*")):
            stem, _, identity = path.name.rpartition(mark)
            if not identity.replace("-", "", 1).isdigit() or _writer_alive(identity):
                continue
            final = directory / stem[1:]
            if mark == OLD_MARK and not final.exists():
                os.replace(path, final)
            else:
                _remove(path)
            touched.append(path)
    if touched:
        fsync_directory(directory)
    return touched


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries: a rename is durable only once its directory is on disk (POSIX)."""
    if os.name != "posix":  # Windows cannot open directories
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (or ``path`` itself) and every directory holding them."""
    if path.is_file():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        return
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb+") as f:
                os.fsync(f.fileno())
        fsync_directory(Path(root))


@contextmanager
def folder_lock(folder: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs: exclusive to change what it holds, shared to read a checkpoint in
    it (advisory ``flock`` on the directory; where the directory cannot be opened or locked, e.g. not POSIX, nothing
    is held)."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def publish(tmp: Path, final: Path) -> None:
    """Make the complete ``tmp`` (file or directory) visible as ``final``, replacing what was there.

    Everything under ``tmp`` is flushed first. A crash at any moment leaves either the previous ``final``
    or the new one under that name (or, between the two renames, the previous one as ``.NAME.old-ID``,
    which :func:`recover_stale` restores); never a partial checkpoint.
    """
    fsync_tree(tmp)
    old = None
    with folder_lock(final.parent, exclusive=True):  # no reader is in the middle of the previous one
        # A file replaces a file in one rename; a directory cannot replace one that exists, so it is moved aside.
        if final.exists() and (final.is_dir() or tmp.is_dir()):
            old = final.with_name(f".{final.name}{OLD_MARK}{writer_identity()}")
            _remove(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_directory(final.parent)
    if old is not None:
        _remove(old)


def remove(path: Path) -> None:
    """Delete the checkpoint ``path`` (file or directory) so that it disappears from its name at once: it is
    renamed to ``.NAME.del-ID`` and then deleted (what a killed removal leaves, :func:`recover_stale` deletes)."""
    if not (path.exists() or path.is_symlink()):
        return
    doomed = path.with_name(f".{path.name}{DELETE_MARK}{writer_identity()}")
    with folder_lock(path.parent, exclusive=True):
        _remove(doomed)
        os.replace(path, doomed)
        fsync_directory(path.parent)
    _remove(doomed)


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's content (hex), read in 4 MiB chunks: what tells two files of one size and time apart."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
