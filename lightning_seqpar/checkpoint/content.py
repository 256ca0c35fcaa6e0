"""What identifies an input by its content: a file's SHA-256, read once per file and run.

Every artefact reused across runs (token caches, supervised caches, the DPO reference cache, LoRA's frozen base) names
its inputs by this digest, never by size and modification time: a file rewritten with other bytes of the same size and
its old time (swapped columns, other weights of the same shapes, ``touch -d``) is another input.

Where the ranks of a run need the same digests (a corpus folder, a pretrained model's weight files), each file is
hashed by one rank and the digests are shared (:func:`spread_digests`): the work is spread over the ranks and no file
is read twice for its digest. Hashing runs at about 0.74 s per GB on one core (docs/checkpoints.md).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.distributed as dist

from lightning_seqpar.checkpoint.atomic import file_digest

_KEPT = 4096
_memo: "OrderedDict[tuple, str]" = OrderedDict()
"""Digests of this process by file identity (path, inode, size, modification and change times): a cache of a pure
function of the content, like ``functools.lru_cache``, that the digests another rank computed can be added to."""


def _identity(path: Path) -> tuple[str, tuple]:
    resolved = Path(path).resolve()
    stat = os.stat(resolved)
    # The change time cannot be set back by a user (os.utime sets only access and modification times), so a file
    # written again is hashed again, whatever its size and modification time say.
    return str(resolved), (str(resolved), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _remember(key: tuple, digest: str) -> None:
    _memo[key] = digest
    _memo.move_to_end(key)
    while len(_memo) > _KEPT:
        _memo.popitem(last=False)


def content_digest(path: Path) -> str:
    """The SHA-256 (hex) of the file at ``path``, computed once per process while the file is unchanged (or received
    from the rank that computed it, :func:`spread_digests`).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    name, key = _identity(path)
    if key not in _memo:
        _remember(key, file_digest(Path(name)))
    _memo.move_to_end(key)
    return _memo[key]


def spread_digests(paths: Iterable[Path], group: Optional[Any] = None) -> dict[str, str]:
    """``{resolved path: SHA-256}`` of ``paths``, each file hashed by one rank of ``group`` (the default group when
    ``None``) and the digests shared, so that every later :func:`content_digest` of these files on any rank of the
    group reads no byte. Files a rank has already hashed are not hashed again; the others go to the ranks largest
    first, each to the rank with the fewest bytes so far. Without an initialized ``torch.distributed`` (or in a group
    of one) the files are hashed here.

    Collective over ``group``: every rank calls it with the same files, which every rank reads at the same paths (a
    shared file system, or identical copies). Two ``all_gather_object`` calls of small dictionaries (one when every
    file was hashed already).

    Raises:
        FileNotFoundError: a path that is no file (on the rank that finds it so; the others then fail in the
            collective, so call it where every rank sees the same files).
    """
    identities = dict(_identity(Path(p)) for p in paths)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {name: content_digest(Path(name)) for name in identities}
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    held = {name: _memo[key] for name, key in identities.items() if key in _memo}
    sizes = {name: key[2] for name, key in identities.items()}
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (held, sizes), group=group)
    known: dict[str, str] = {}
    for other_held, _ in reports:
        known.update(other_held)
    missing = sorted((name for name in identities if name not in known), key=lambda n: (-reports[0][1][n], n))
    if missing:
        load, mine = [0] * world, {}
        for name in missing:  # the same assignment on every rank: it reads only what every rank received
            owner = min(range(world), key=lambda r: (load[r], r))
            load[owner] += reports[0][1][name]
            if owner == rank:
                mine[name] = content_digest(Path(name))
        computed: list[Any] = [None] * world
        dist.all_gather_object(computed, mine, group=group)
        for part in computed:
            known.update(part)
    for name, key in identities.items():
        _remember(key, known[name])
    return {name: known[name] for name in identities}
