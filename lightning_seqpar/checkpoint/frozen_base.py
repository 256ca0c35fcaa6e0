"""A sharded checkpoint of a run whose frozen weights (LoRA's base) come from a pretrained directory: the frozen
tensors are not written again; the checkpoint records where they were read from, and a resume reads them from there,
refused when the directory or its files are not the same.

The record (``FrozenBase``): the directory's absolute path and each weight file's name, size and modification time,
and the frozen state-dict keys. A resume whose model reads its frozen weights from the same files (the
LightningModule calls ``load_single_device_state_dict(DIR)`` in ``configure_model`` whether resuming or not) loads the
trainable tensors from the checkpoint and nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn

@dataclass(frozen=True)
class FrozenBase:
    """Where a run's frozen weights were read from (see the module docstring)."""

    directory: str
    files: dict[str, list[int]]
    """``{file name: [bytes, mtime in ns]}`` of the weight files and their index"""
    keys: list[str] = field(default_factory=list)

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
        return FrozenBase(self.directory, self.files,
                          sorted(k for k in module.state_dict(keep_vars=True) if id(params.get(k)) in frozen))

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    def mismatch(self, saved: dict[str, Any]) -> Optional[str]:
        """Why the checkpoint's record ``saved`` is not this run's base (``None``: the same directory and files)."""
        if saved["directory"] != self.directory:
            return f"its frozen weights were read from {saved['directory']}, this run reads them from {self.directory}"
        changed = sorted(set(saved["files"]) ^ set(self.files)) + sorted(
            name for name in set(saved["files"]) & set(self.files) if list(saved["files"][name]) != self.files[name])
        if changed:
            return f"the files of {self.directory} changed since it was saved: {changed[:8]}"
        return None
