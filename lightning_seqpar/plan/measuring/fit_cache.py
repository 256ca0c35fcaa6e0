"""The probes' fits kept on disk, so a question asked again (or differing only in GPU count, memory, batch or sequence
length) is answered without probing small copies of the model again; and the models' inventories
(:class:`~.inventory_record.InventoryRecord`, keyed by the config and what is trained), so it builds no model either.

A fit is keyed by what it was measured from: the model's config, attention and trained parts
(:attr:`~.inventory.ModelInventory.probe_key`), the layout's tensor-parallel size, recomputation, precision, and so
on (the planner's own keys), and by everything that measured it (:func:`library_salt`): the versions of torch,
transformers and PEFT, and the digest of this package's source, so a changed library or a fixed probe measures
again instead of reading an old answer. One JSON file per fit, written whole (a temporary file renamed over it), so
two planners asking at once never read half of one; a file that does not read back as the fit it names is measured
again, never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, Optional


def _fit_types() -> dict[str, type]:
    """The fits a cache holds, by name: only these are read back (a file naming anything else is a miss)."""
    from lightning_seqpar.plan.measuring.inventory_record import InventoryRecord
    from lightning_seqpar.plan.measuring.probe import LayerFit, OutsideFit
    from lightning_seqpar.plan.measuring.work import ContextWork, WorkFit

    return {kind.__name__: kind for kind in (LayerFit, OutsideFit, WorkFit, ContextWork, InventoryRecord)}


def library_salt() -> str:
    """What measured a fit: the versions of torch, transformers and PEFT (those installed, as their distributions say:
    importing PEFT to ask would cost a repeated answer seconds) and the SHA-256 of this package's Python source (every
    file, by path and content), as one hex digest."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for name in ("torch", "transformers", "peft"):
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "absent"
        digest.update(f"{name}={installed};".encode())
    package = Path(__file__).resolve().parents[2]  # this file is lightning_seqpar/plan/measuring/fit_cache.py
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def default_cache_directory() -> Path:
    """``$LIGHTNING_SEQPAR_CACHE/plan``, else ``$XDG_CACHE_HOME/lightning_seqpar/plan``, else
    ``~/.cache/lightning_seqpar/plan``."""
    own = os.environ.get("LIGHTNING_SEQPAR_CACHE")
    if own:
        return Path(own) / "plan"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_seqpar" / "plan"


class FitCache(MutableMapping):
    """The planner's ``fits`` (:func:`~..planner.plan`) read from and written to ``directory``.

    Args:
        directory: where the fits live (made when the first is written).
        salt: what measured them (:func:`library_salt`; computed when not given).

    Attributes:
        read, written: how many fits came from disk and how many were measured and stored, for the answer to say.
        inventories_read, inventories_written: the same of the models' inventories.
    """

    def __init__(self, directory: Path, salt: Optional[str] = None) -> None:
        self.directory = Path(directory)
        self.salt = library_salt() if salt is None else salt
        self._held: dict[Any, Any] = {}
        self._types = _fit_types()
        self.read = self.written = self.inventories_read = self.inventories_written = 0

    def _path(self, key: Any) -> Path:
        return self.directory / f"{hashlib.sha256(f'{self.salt}|{key!r}'.encode()).hexdigest()}.json"

    def _load(self, key: Any) -> Optional[Any]:
        try:
            stored = json.loads(self._path(key).read_text())
            if stored.get("key") != repr(key) or stored.get("salt") != self.salt:
                return None
            kind = self._types[stored["type"]]
            fields = {name: tuple(value) if isinstance(value, list) else value
                      for name, value in stored["fields"].items()}
            return kind(**fields)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # absent, half a file from another writer's crash, or another format: measured again

    def __getitem__(self, key: Any) -> Any:
        if key not in self._held:
            fit = self._load(key)
            if fit is None:
                raise KeyError(key)
            self._held[key] = fit
            if type(fit).__name__ == "InventoryRecord":
                self.inventories_read += 1
            else:
                self.read += 1
        return self._held[key]

    def __contains__(self, key: object) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __setitem__(self, key: Any, fit: Any) -> None:
        self._held[key] = fit
        if type(fit).__name__ not in self._types or not dataclasses.is_dataclass(fit):
            return  # not a fit this cache knows how to read back: held for this question only
        self.directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dict(key=repr(key), salt=self.salt, type=type(fit).__name__,
                               fields=dataclasses.asdict(fit)))
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, self._path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        if type(fit).__name__ == "InventoryRecord":
            self.inventories_written += 1
        else:
            self.written += 1

    def __delitem__(self, key: Any) -> None:
        del self._held[key]
        self._path(key).unlink(missing_ok=True)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
