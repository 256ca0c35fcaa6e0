"""A sharded checkpoint of a run whose frozen weights (LoRA's base) come from a pretrained directory: the frozen
tensors are not written again; the checkpoint records where they were read from, and a resume reads them from there,
refused when the directory or its files are not the same.

The record (``FrozenBase``): the directory's absolute path, each weight file's name, size and modification time, the
SHA-256 of each file's content, and the frozen state-dict keys. Size and time alone would accept other weights of the
same shapes written with the old time (or one flipped byte), so a resume compares content: the base's weight files are
hashed once per run, when the first checkpoint is written or when the run resumes, each file by one rank
(:func:`~.content.spread_digests`: the files of an 8-file base on 8 ranks take one file's time). A record
written before digests existed is compared by size and time. A resume whose model reads its frozen weights from the same files (the
LightningModule calls ``load_single_device_state_dict(DIR)`` in ``configure_model`` whether resuming or not) loads the
trainable tensors from the checkpoint and nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn

from lightning_seqpar.checkpoint.content import spread_digests

@dataclass(frozen=True)
class FrozenBase:
    """Where a run's frozen weights were read from (see the module docstring)."""

    directory: str
    files: dict[str, list[int]]
    """``{file name: [bytes, mtime in ns]}`` of the weight files and their index"""
    keys: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    """``{file name: SHA-256}``; empty until :meth:`with_digests` (hashing costs a read of the files)"""

    @classmethod
    def of(cls, source: Path) -> "FrozenBase":
        source = source.resolve()
        directory = source if source.is_dir() else source.parent
        paths = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"
                       or p.name.endswith(".safetensors.index.json")) if source.is_dir() else [source]
        return cls(str(directory), {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in paths})

    def with_keys(self, module: nn.Module) -> "FrozenBase":
        """This record with the frozen state-dict keys of ``module`` (those the checkpoint leaves out)."""
        frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        params = dict(module.named_parameters(remove_duplicate=False))
        return replace(self, keys=sorted(k for k in module.state_dict(keep_vars=True) if id(params.get(k)) in frozen))

    def with_digests(self, group: Optional[Any] = None) -> "FrozenBase":
        """This record with each file's content digest, unless already held: collective over ``group`` (the default
        group when ``None``), each file hashed by one of its ranks (:func:`~.content.spread_digests`)."""
        if self.digests:
            return self
        names = sorted(self.files)
        digests = spread_digests([Path(self.directory) / name for name in names], group)
        return replace(self, digests={name: digests[str((Path(self.directory) / name).resolve())] for name in names})

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    def mismatch(self, saved: dict[str, Any]) -> Optional[str]:
        """Why the checkpoint's record ``saved`` is not this run's base (``None``: the same directory and files, by
        content when ``saved`` holds digests: this record must then hold them too)."""
        if saved["directory"] != self.directory:
            return f"its frozen weights were read from {saved['directory']}, this run reads them from {self.directory}"
        names = set(saved["files"]) | set(self.files)
        changed = sorted(names - (set(saved["files"]) & set(self.files)))
        common = sorted(set(saved["files"]) & set(self.files))
        if saved.get("digests"):
            assert self.digests, "compare content with a record from with_digests()"
            changed += [name for name in common if saved["digests"].get(name) != self.digests.get(name)]
            what = "content"
        else:  # a record from before digests: size and time
            changed += [name for name in common if list(saved["files"][name]) != list(self.files[name])]
            what = "size or modification time"
        if changed:
            return f"the files of {self.directory} changed ({what}) since it was saved: {sorted(changed)[:8]}"
        return None
