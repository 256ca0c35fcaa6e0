"""The reference model's log-probabilities of every preference pair, computed once before DPO training, and their
cache file.

Full fine-tuning keeps no frozen copy of the starting model, so it reads the reference from the batch instead
(``reference_logps``, :class:`~lightning_seqpar.data.preference_datamodule.PreferenceDataModule`); LoRA makes it in
each step (its base with the adapters off). :func:`compute_reference_logps` runs
the model as it stands before the first step (LoRA: adapters off) forward-only over both splits, through the same
strategy, layout and loss path as training (``trainer.validate`` with the module collecting instead of logging),
every pair once, and gathers the values on every rank.

The cache (:func:`write_reference`, :func:`read_reference`) is one JSON file, published atomically: ``version``, the
``identity`` it was made for (the model directory's config and weight files by size and content digest, SHA-256,
never by modification time; the data file likewise; the tokenizer, chat template, ``block_size``, ``overflow`` and
``val_fraction``; packed rows under ``overflow="truncate"``, which cut a long pair otherwise), the values per split
(``[pairs, 2]``: chosen, rejected; float64 written by ``repr``, read back bit for bit) and the SHA-256 of the values.
A cache made for another identity, or whose digest does not match, is refused by name (the recipe then computes
the values again); it never feeds training silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.checkpoint.content import content_digest, spread_digests
from lightning_seqpar.data.supervised import template_identity

log = logging.getLogger(__name__)

REFERENCE_VERSION = 1
SPLITS = ("training", "validation")


class ReferenceCollector:
    """Per-row log-probabilities by pair index, filled by the module's ``validation_step`` during a reference pass
    (on the last pipeline stage: the only one that computes them)."""

    def __init__(self) -> None:
        self.values: dict[int, tuple[float, float]] = {}

    def add(self, pair_index: torch.Tensor, logps: torch.Tensor) -> None:
        """``pair_index``, ``logps`` ``[2b]`` (rows ``2i`` chosen, ``2i+1`` rejected); packed rows: ``pair_index``
        ``[b, K]`` (``-1`` an empty slot) and ``logps`` ``[b, 2K]`` (slots ``2k`` chosen, ``2k+1`` rejected)."""
        index = (pair_index if pair_index.dim() == 2 else pair_index[0::2]).reshape(-1).tolist()
        values = logps.detach().to(torch.float64).reshape(-1, 2).tolist()
        for i, (chosen, rejected) in zip(index, values):
            if i >= 0:
                self.values[int(i)] = (chosen, rejected)


def _gather(values: dict[int, tuple[float, float]], pairs: int, split: str) -> np.ndarray:
    """Every rank's collected values as ``[pairs, 2]`` on every rank (ranks of one replica hold the same values).

    Raises:
        RuntimeError: a pair no rank computed.
    """
    parts = [values]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, values)
    out = np.full((pairs, 2), np.nan, dtype=np.float64)
    for part in parts:
        for i, pair in part.items():
            out[i] = pair
    missing = np.flatnonzero(np.isnan(out).any(1))
    if len(missing):
        raise RuntimeError(f"The reference pass over the {split} split computed no value for pairs "
                           f"{missing[:8].tolist()}: its loader did not cover the split.")
    return out


def compute_reference_logps(trainer: Any, module: Any, data: Any) -> dict[str, np.ndarray]:
    """The reference log-probabilities ``{split: [pairs, 2]}`` of ``data``'s pairs under ``module``'s current weights
    (LoRA: adapters off), on every rank; collective (every rank calls it, before ``trainer.fit``).

    Args:
        trainer: the run's trainer (its strategy and layout compute the values).
        module: a :class:`~lightning_seqpar.models.finetune.FineTuneModule` with ``objective="dpo"``.
        data: the run's :class:`~lightning_seqpar.data.preference_datamodule.PreferenceDataModule` (set up here).

    Raises:
        RuntimeError: a pair left uncomputed.
    """
    out = {}
    # Every pair needs its value, whatever the run's trainer.limit_val_batches bounds its validation to.
    limit, trainer.limit_val_batches = trainer.limit_val_batches, 1.0
    for split in SPLITS:
        module.reference_collector, data.reference_split = ReferenceCollector(), split
        try:
            trainer.validate(module, datamodule=data, verbose=False)
            collected = module.reference_collector.values
        finally:
            module.reference_collector, data.reference_split = None, None
            trainer.limit_val_batches = limit
        rows = data.train_rows if split == "training" else data.val_rows
        out[split] = _gather(collected, rows.pairs, split)
    return out


def _file_identity(path: Path) -> dict:
    """A file by content (a file rewritten with the same size and time is another input)."""
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": content_digest(path)}


def reference_identity(pretrained: str, data: Any) -> dict:
    """What the values depend on (see the module docstring): a cache made for another identity is not read."""
    model = Path(pretrained)
    files = sorted(p for p in model.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    spread_digests([*files, data.path])  # each file hashed by one rank once the ranks are connected (every rank calls)
    identity = {"model": [_file_identity(p) for p in files], "data": _file_identity(data.path),
                "tokenizer": data.tokenizer.identity, "chat_template": template_identity(data.tokenizer),
                "block_size": data.block_size, "overflow": data.overflow, "val_fraction": data.val_fraction}
    if getattr(data, "packing", False) and data.overflow == "truncate":  # a long pair is cut otherwise when packed
        identity["packing"] = True
    return identity


def _digest(values: dict[str, list]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def write_reference(path: Path, values: dict[str, np.ndarray], identity: dict) -> None:
    """Publish the cache at ``path`` atomically (see the module docstring)."""
    path = Path(path)
    lists = {split: values[split].tolist() for split in SPLITS}
    body = {"version": REFERENCE_VERSION, "identity": identity, "values": lists, "sha256": _digest(lists)}
    tmp = temporary_path(path)
    tmp.write_text(json.dumps(body))
    publish(tmp, path)


def read_reference(path: Path, identity: Optional[dict]) -> dict[str, np.ndarray]:
    """The cached values ``{split: [pairs, 2]}``, checked (see the module docstring).

    Args:
        identity: what the values must have been made for (``None``: not compared).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a reference cache, another version, damaged (its digest differs from its values), or made
            for another model, data or settings (naming what differs).
    """
    path = Path(path)
    try:
        body = json.loads(path.read_text())
        values, digest = body["values"], body["sha256"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a DPO reference cache, or is damaged ({type(error).__name__}: {error}). "
                         f"Delete it: the recipe computes the reference log-probabilities again.") from None
    if body.get("version") != REFERENCE_VERSION:
        raise ValueError(f"{path} is a reference cache of version {body.get('version')}; this version reads "
                         f"{REFERENCE_VERSION}. Delete it to compute it again.")
    if _digest(values) != digest:
        raise ValueError(f"{path} is damaged: its values do not match their SHA-256. Delete it to compute the "
                         f"reference log-probabilities again.")
    if identity is not None and body.get("identity") != identity:
        made = body.get("identity") or {}
        differ = sorted(k for k in set(made) | set(identity) if made.get(k) != identity.get(k))
        raise ValueError(f"{path} was computed for another {', '.join(differ)} than this run's: its values are not "
                         f"this run's reference. Delete it (or point dpo.reference elsewhere) to compute them again.")
    return {split: np.asarray(values[split], dtype=np.float64).reshape(-1, 2) for split in SPLITS}


KEPT_REFERENCES = 4
"""Default-path caches kept per data file: the newest, by when each was written or last read."""


def default_reference_path(data: Any, identity: dict) -> Path:
    """``FILE.dpo-reference/<key>.json``, one folder beside the data for every cache of it, each keyed by its identity's
    hash (another model, tokenizer or setting: another file; :func:`prune_references` keeps the newest few)."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return data.path.resolve().with_name(f"{data.path.name}.dpo-reference") / f"{key}.json"


def prune_references(folder: Path, keep: int = KEPT_REFERENCES) -> list[Path]:
    """Delete all but the ``keep`` newest caches of the default folder ``folder`` (by modification time: a cache read
    is touched), and the caches earlier releases wrote beside the data (``FILE.dpo-reference-<key>.json``). Returns
    what was deleted."""
    caches = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    legacy = sorted(folder.parent.glob(f"{folder.name}-*.json"))
    gone = caches[keep:] + legacy
    for path in gone:
        path.unlink(missing_ok=True)
    return gone


def reference_for_run(trainer: Any, module: Any, data: Any, path: Optional[str] = None
                      ) -> Optional[dict[str, np.ndarray]]:
    """The reference log-probabilities a DPO run reads from its batches, or ``None`` when the module computes them in
    each step (LoRA, under every layout). Collective (every rank calls it, before ``trainer.fit``).

    Read from the cache at ``path`` (default :func:`default_reference_path`) when it was made for this run's identity;
    otherwise computed (:func:`compute_reference_logps`) and written there by global rank 0, which then keeps the
    :data:`KEPT_REFERENCES` newest caches of the default folder (:func:`prune_references`; a ``path`` given is never
    pruned).

    Raises:
        ValueError: ``path`` given explicitly and holding a cache that is damaged or made for another identity (a
            default-path cache that does not match is computed again instead, since its name is this identity's).
    """
    if module.lora is not None:  # the base with its adapters off, in each step (under pp, module.reference_step)
        return None
    identity = reference_identity(module.pretrained, data)
    target = Path(path).resolve() if path else default_reference_path(data, identity)
    if target.exists():
        try:
            values = read_reference(target, identity)
            if not path and trainer.global_rank == 0:
                target.touch()  # read: among the newest the default folder keeps
            return values
        except ValueError:
            if path:
                raise
            log.warning("The DPO reference cache %s is damaged: computed again.", target)
    values = compute_reference_logps(trainer, module, data)
    if trainer.global_rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_reference(target, values, identity)
        log.info("DPO reference log-probabilities of %d + %d pairs written to %s", len(values["training"]),
                 len(values["validation"]), target)
        if not path:
            for gone in prune_references(target.parent):
                log.info("DPO reference cache %s deleted (the %d newest of %s are kept)", gone, KEPT_REFERENCES,
                         data.path.name)
    return values
