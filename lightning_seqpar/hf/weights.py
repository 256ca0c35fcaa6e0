"""A Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, with or without
``model.safetensors.index.json``) read lazily, each rank only the rows of its own shards.

:class:`SafetensorsStateDict` maps state-dict keys to :class:`LazyTensor` handles without reading any
data; :func:`~lightning_seqpar.tensor_parallel.sharding.load_from_full` copies a handle into a module's
tensor, reading only this rank's rows of a sharded parameter through ``safetensors``' slices
(``safe_open(f).get_slice(name)[a:b]``). Needs the ``safetensors`` package (``pip install lightning_seqpar[hf]``),
imported when used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch
from torch import Tensor


INDEX_FILE = "model.safetensors.index.json"


class LazyTensor:
    """One tensor of a safetensors file, not read yet. ``shape`` is known; :meth:`rows` reads a range of a dim."""

    def __init__(self, file: Path, name: str, shape: tuple[int, ...]) -> None:
        self.file, self.name, self.shape = file, name, torch.Size(shape)

    def rows(self, dim: int, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of dim ``dim`` (only those bytes are read)."""
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            index = (slice(None),) * dim + (slice(start, stop),)
            return f.get_slice(self.name)[index]

    def read(self) -> Tensor:
        """The whole tensor."""
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.name)


class PackedExperts:
    """A packed expert weight ``[E, Σ parts' rows, …]`` of a checkpoint that stores one tensor per expert and part
    (:class:`~lightning_seqpar.hf.checkpoint_keys.ExpertPiece`), read lazily like :class:`LazyTensor`: :meth:`rows` of
    dim 0 reads only those experts' tensors (a rank's ``E/e`` experts).

    Raises:
        ValueError: at construction, an expert or part missing, or parts whose shapes do not join, naming the key.
    """

    def __init__(self, key: str, pieces: Mapping[tuple[int, int], LazyTensor], parts: int) -> None:
        experts = 1 + max(expert for expert, _ in pieces)
        missing = [f"expert {e} part {p}" for e in range(experts) for p in range(parts) if (e, p) not in pieces]
        if missing:
            raise ValueError(f"The checkpoint stores {key} one tensor per expert, and lacks {', '.join(missing[:6])}"
                             f"{' ...' if len(missing) > 6 else ''}: it is incomplete.")
        shapes = [pieces[(0, p)].shape for p in range(parts)]
        if any(pieces[(e, p)].shape != shapes[p] for e in range(experts) for p in range(parts)) or any(
                shape[1:] != shapes[0][1:] for shape in shapes):
            raise ValueError(f"The checkpoint's per-expert tensors of {key} differ in shape: they do not pack into "
                             f"one [experts, rows, ...] weight.")
        self.pieces, self.parts = pieces, parts
        self.shape = torch.Size((experts, sum(shape[0] for shape in shapes), *shapes[0][1:]))

    def rows(self, dim: int, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of dim ``dim``; along dim 0 (experts) only those experts' tensors are read."""
        if dim != 0:
            return self.read().narrow(dim, start, stop - start)
        return torch.stack([torch.cat([self.pieces[(e, p)].read() for p in range(self.parts)])
                            for e in range(start, stop)])

    def read(self) -> Tensor:
        """The whole packed tensor."""
        return self.rows(0, 0, self.shape[0])


class SafetensorsStateDict(Mapping[str, LazyTensor]):
    """The state dict stored in a Hugging Face checkpoint directory, keys prefixed by ``prefix`` (the attribute
    path of the Hugging Face model inside your LightningModule, e.g. ``"model."``), each stored name first passed
    through ``rename`` when given (the model's own renamings: :mod:`lightning_seqpar.hf.checkpoint_keys`; per-expert
    tensors become one :class:`PackedExperts` under the model's packed key).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``directory``.
        ImportError: without the safetensors package, with the install command.
    """

    def __init__(self, directory: os.PathLike | str, prefix: str = "",
                 rename: Optional[Callable[[str], str]] = None) -> None:
        _require_safetensors("Reading")
        from safetensors import safe_open

        directory = Path(directory)
        index = directory / INDEX_FILE
        if index.is_file():
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else [directory]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"No .safetensors weights found in {directory}.")
        self._tensors: dict[str, LazyTensor] = {}
        packed: dict[str, tuple[dict[tuple[int, int], LazyTensor], int]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    key = rename(name) if rename is not None else name
                    tensor = LazyTensor(file, name, tuple(f.get_slice(name).get_shape()))
                    if isinstance(key, str):
                        self._tensors[prefix + key] = tensor
                    else:  # one expert's part of a packed weight
                        packed.setdefault(prefix + key.target, ({}, key.parts))[0][(key.expert, key.part)] = tensor
        for key, (pieces, parts) in packed.items():
            self._tensors[key] = PackedExperts(key, pieces, parts)  # type: ignore[assignment]

    def __getitem__(self, key: str) -> LazyTensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _require_safetensors(action: str) -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{action} .safetensors needs the safetensors package: pip install 'lightning_seqpar[hf]' "
                          f"(or pip install safetensors).") from error


def save_safetensors_file(state_dict: Mapping[str, Tensor], path: os.PathLike | str,
                          metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``state_dict`` to the safetensors file ``path`` (in place: the caller publishes it atomically).

    safetensors refuses tensors sharing memory: a tensor stored under two keys (a tied weight) is copied.

    Raises:
        ImportError: without the safetensors package, with the install command.
    """
    _require_safetensors("Writing")
    from safetensors.torch import save_file

    stored: set[int] = set()
    tensors = {}
    for key, value in state_dict.items():
        value = value.detach().contiguous()
        tensors[key] = value.clone() if value.data_ptr() in stored else value
        stored.add(value.data_ptr())
    save_file(tensors, str(path), metadata=metadata)


def load_safetensors_file(path: os.PathLike | str) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path``.

    Raises:
        ImportError: without the safetensors package, with the install command.
    """
    _require_safetensors("Reading")
    from safetensors.torch import load_file

    return load_file(str(path))
