"""A parallel model exported as the Hugging Face directory ``from_pretrained`` loads, without a whole model anywhere.

Every rank states the tensors it holds; the plan (which tensors, in which file, written by which rank) is then
the same on every rank. Each pipeline stage writes the files of its own tensors: for every tensor, the stage's
tensor-parallel ranks (of data-parallel replica 0) gather their shards on tensor-parallel rank 0, which streams
the single-device tensor into its file (:class:`~lightning_seqpar.hf.streaming.SafetensorsStreamWriter`) and
drops it before the next. So a rank holds at most its own shards plus one tensor's gathered shards, and the
stages write in parallel. Rank 0 then adds the index, ``config.json`` and the source directory's tokenizer and
generation files, and publishes the directory atomically.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.checkpoint.atomic import publish, recover_stale, temporary_path
from lightning_seqpar.checkpoint.destination import export_refusal, mark_export
from lightning_seqpar.checkpoint.sharded import _unique_tensors
from lightning_seqpar.hf.streaming import (
    SafetensorsStreamWriter, TensorEntry, check_storable, file_names, finish_directory, split_into_files,
)
from lightning_seqpar.hf.checkpoint_keys import ExpertPiece
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import REPLICA_GROUPS, SHARD_GROUPS, ShardSpec, placement_of, shard_spec
from lightning_seqpar.tensor_parallel.sharding import full_shape
from lightning_seqpar.sizes import parse_bytes
from lightning_seqpar.transformer.materialize import release_freed_memory

_BLOCK_BYTES = 16 * 2**20


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``max_shard_size`` (:func:`~lightning_seqpar.sizes.parse_bytes`: ``5_000_000``, ``"5GB"``, ``"4GiB"``).

    Raises:
        ValueError: anything else, naming the value.
    """
    return parse_bytes(size, "max_shard_size")


def unsharded_pieces(shards: list[Tensor], spec: ShardSpec) -> Iterator[Tensor]:
    """The single-device tensor assembled from every rank's shard, as consecutive row-major pieces (vocabulary
    padding left out): shards split along dim 0 are written as they are; other splits by blocks of rows."""
    if spec.dim == 0:
        local_blocks = [size // len(shards) for size in spec.blocks()]
        full_blocks = spec.chunk_sizes or (spec.full_size // spec.chunks,) * spec.chunks
        for c in range(spec.chunks):
            left = full_blocks[c]
            for shard in shards:
                piece = shard.split(local_blocks, dim=0)[c]
                if left > 0:
                    yield piece[: min(piece.shape[0], left)]
                left -= piece.shape[0]
        return
    row_bytes = max(1, shards[0][0].numel() * shards[0].element_size() * len(shards))
    step = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, shards[0].shape[0], step):
        yield spec.unshard([shard[start:start + step] for shard in shards])


def _plan(module: nn.Module, mesh: ParallelMesh, prefix: str, dtype: Optional[torch.dtype],
          max_file_bytes: int, view: Optional[Callable[[dict[str, Tensor]], dict[str, Tensor]]] = None
          ) -> tuple[dict[str, Tensor], list[list[TensorEntry]], list[int]]:
    """This rank's tensors by name, the files (entries in order) and the pipeline stage writing each file."""
    unique, _ = _unique_tensors(module)  # a tied tensor once, under its first key (save_pretrained's choice)
    if view is not None:  # e.g. a PEFT model's keys as the base model's (checkpoint.peft_export.MergedLoRA)
        unique = view(unique)
    mine = {name[len(prefix):]: value for name, value in unique.items() if name.startswith(prefix)}
    hub_names, hub_key = _hub_naming(module, prefix)
    entries = []
    for name, value in list(mine.items()):
        shape = full_shape(value)
        pieces = hub_names(name, shape[0]) if hub_names is not None and _over_experts(value) else None
        if pieces is None:
            stored = hub_key(name)
            entries.append(TensorEntry(stored, dtype or value.dtype, shape))
            mine[stored] = value
            continue
        # Packed experts [E, rows, ...] written as the hub's per-expert tensors, each expert's parts along its rows.
        piece_shape = (shape[1] // len(pieces[0]), *shape[2:])
        for e, names in enumerate(pieces):
            for p, piece in enumerate(names):
                stored = hub_key(piece)
                entries.append(TensorEntry(stored, dtype or value.dtype, piece_shape))
                mine[stored] = ExpertPiece(name, e, p, len(names))  # type: ignore[assignment]
    coordinates = (mesh.pipeline.rank, not _stage_writer(mesh))
    everyone: list[Any] = [(coordinates, entries)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (coordinates, entries))
    per_stage: dict[int, list[TensorEntry]] = {}
    seen: set[str] = set()
    for (stage, not_writer), stated in sorted(everyone, key=lambda item: item[0]):
        if not_writer:
            continue
        per_stage[stage] = [e for e in stated if e.name not in seen]  # shared parts: the first stage writes them
        seen.update(e.name for e in stated)
    if not seen:
        raise ValueError(f"No tensor of the model is under prefix '{prefix}': pass the attribute path of the Hugging "
                         f"Face model inside your LightningModule (e.g. prefix='model.').")
    check_storable([e for stage in per_stage.values() for e in stage])
    stages = sorted(per_stage)
    files, writers = [], []
    for stage in stages:
        cut = split_into_files([per_stage[stage]], max_file_bytes)
        files += cut
        writers += [stage] * len(cut)
    return mine, files, writers


def _over_experts(value: Tensor) -> bool:
    """Whether ``value`` is split over the expert-parallel group (every rank of a stage holds some experts)."""
    return isinstance(value, Tensor) and placement_of(value).shard_over == "ep" and shard_spec(value) is not None


def _hub_naming(module: nn.Module, prefix: str) -> tuple[Optional[Callable[[str, int], Optional[list[list[str]]]]],
                                                        Callable[[str], str]]:
    """The names ``save_pretrained`` gives the Hugging Face model under ``prefix``: its packed experts' per-expert
    pieces (``None``: it packs none), and each key with the family's renamings reversed (the identity: none)."""
    from lightning_seqpar.hf.checkpoint_keys import expert_piece_names, hub_key_namer

    try:
        model = module.get_submodule(prefix.rstrip(".")) if prefix.rstrip(".") else module
        pieces, renamed = expert_piece_names(model), hub_key_namer(model)
    except (AttributeError, TypeError, ValueError):  # no Hugging Face model there: keys as they are
        return None, _same
    return pieces, renamed or _same


def _same(key: str) -> str:
    return key


def export_hf_pretrained(module: nn.Module, mesh: ParallelMesh, out: os.PathLike | str, config: Any, *,
                         prefix: str = "model.", source: Optional[os.PathLike | str] = None,
                         max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None,
                         tokenizer: Any = None, overwrite: bool = False,
                         protected: Sequence[Optional[os.PathLike | str]] = (),
                         view: Optional[Callable[[dict[str, Tensor]], dict[str, Tensor]]] = None,
                         transform: Optional[Callable[[str, Tensor], Tensor]] = None) -> Path:
    """Write ``module``'s Hugging Face model (the keys under ``prefix``) as a directory ``from_pretrained`` loads.

    Collective over the default process group: every rank calls it. Safetensors files of at most
    ``max_shard_size`` each (one file: ``model.safetensors``; more: ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``), ``config.json`` from ``config``, and the tokenizer and generation files of
    the model directory ``source`` (``tokenizer.save_pretrained`` replaces the tokenizer's, when given). Tensors are
    written in ``dtype`` (default: as trained). Peak memory of any
    rank: its shards plus one gathered tensor (and a 16 MiB block of rows). Returns ``out``. ``out`` must be new,
    empty or a previous export (replaced with ``overwrite``), and neither be nor hold a ``protected`` folder
    (:mod:`lightning_seqpar.checkpoint.destination`). ``view`` maps the module's tensors (by state-dict key, this
    rank's shards) to those written; ``transform(name, shard)`` gives what is written of each, computed when it is
    written (LoRA merged into its base weight), so no rank holds more than one transformed tensor.

    Raises:
        ValueError: nothing under ``prefix``; a dtype safetensors cannot store; a bad ``max_shard_size``, on every
            rank before anything is written.
        FileExistsError: a destination that must not be written (rank 0 decides; raised on every rank).
    """
    mine, files, writers = _plan(module, mesh, prefix, dtype, parse_size(max_shard_size), view)
    out = Path(out)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    decided = [str(temporary_path(out)), export_refusal(out, overwrite=overwrite, protected=protected)]
    if distributed:  # what rank 0 sees decides: every rank refuses, or none
        dist.broadcast_object_list(decided, src=0)
    if decided[1] is not None:
        raise FileExistsError(decided[1])
    tmp_dir = Path(decided[0])
    if not distributed or dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        recover_stale(out.parent)  # what exports (and other writers) killed earlier left there
        tmp_dir.mkdir()
    if distributed:
        dist.barrier()
    try:
        names = file_names(len(files))
        for name, file, stage in zip(names, files, writers):  # each rank takes part in the tensors it gathers
            if stage == mesh.pipeline.rank:
                _write_file(tmp_dir / name, file, mine, mesh, transform)
        if distributed:
            dist.barrier()
        if not distributed or dist.get_rank() == 0:
            finish_directory(tmp_dir, files, config, source, tokenizer)
            mark_export(tmp_dir, "training")
            publish(tmp_dir, out)
    finally:
        if (not distributed or dist.get_rank() == 0) and tmp_dir.exists():
            shutil.rmtree(tmp_dir)
    if distributed:
        dist.barrier()
    return out


def _stage_writer(mesh: ParallelMesh) -> bool:
    """Whether this rank writes its pipeline stage's files: the stage's first rank, rank 0 of every group a parameter
    can be split or replicated over, so every tensor's gather ends on it."""
    return all(mesh.group(name).rank == 0 for name in (*SHARD_GROUPS, *REPLICA_GROUPS))


def _write_file(path: Path, entries: list[TensorEntry], mine: dict[str, Tensor], mesh: ParallelMesh,
                transform: Optional[Callable[[str, Tensor], Tensor]] = None) -> None:
    """One file of this stage. Each sharded tensor is gathered over the group its placement splits it over (tp; ep for
    experts) by the ranks of its first replica (rank 0 of the group it is replicated over), onto the stage's writer;
    packed experts are written as the hub's per-expert tensors where the family stores them so (:class:`ExpertPiece`
    entries), each piece straight from its rank's shard."""
    writer = SafetensorsStreamWriter(path, entries) if _stage_writer(mesh) else None
    gathered: Optional[tuple[str, Optional[Tensor]]] = None  # the packed expert tensor whose pieces are being written
    try:
        for entry in entries:
            piece = mine[entry.name]
            if isinstance(piece, ExpertPiece):
                if gathered is None or gathered[0] != piece.target:
                    gathered = None  # released before the next is gathered
                    gathered = (piece.target, _shards(mine[piece.target], mesh, transform, piece.target))
                shards = gathered[1]
                if writer is not None:
                    local, rows = shards.shape[1], shards.shape[2] // piece.parts
                    expert = shards[piece.expert // local][piece.expert % local]
                    writer.write(entry.name, expert.narrow(0, piece.part * rows, rows))
                continue
            param = mine[entry.name]
            spec = shard_spec(param)
            if spec is None:
                if writer is not None:
                    value = param.detach()
                    writer.write(entry.name, value if transform is None else _transformed(transform, entry.name, value))
                continue
            shards = _shards(param, mesh, transform, entry.name)
            if writer is not None:
                writer.write_pieces(entry.name, unsharded_pieces(list(shards.unbind(0)), spec))
            del shards
            release_freed_memory()  # glibc would keep the freed tensor's pages resident for the next one
    except BaseException:
        if writer is not None:
            writer.close(check=False)
        raise
    if writer is not None:
        writer.close()


def _transformed(transform: Callable[[str, Tensor], Tensor], name: str, value: Tensor) -> Tensor:
    with torch.no_grad():
        return transform(name, value)


def _shards(param: Tensor, mesh: ParallelMesh, transform: Optional[Callable[[str, Tensor], Tensor]] = None,
            name: str = "") -> Optional[Tensor]:
    """Every rank's shard of ``param`` stacked on the writer (``[n, *shard]``), gathered over its placement's split
    group (its second split, if any, undone first) by the ranks of its first replica; ``None`` on every other rank (the others of the group, and every rank of
    the other replicas, which take no part)."""
    placement = placement_of(param)
    if mesh.group(placement.replicated_over).rank != 0:
        return None
    value = param.detach()
    if transform is not None:
        value = _transformed(transform, name, value)
    if placement.inner is not None:  # an expert's width over etp: whole experts first, then stacked over ep
        value = placement.inner.gather(value, mesh.group(placement.inner_over))
    return mesh.group(placement.shard_over).gather(value)
