"""The fine-tuning data module: JSON Lines of conversations, prompt/completion pairs or texts, as supervised rows."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_seqpar.checkpoint.content import content_digest, spread_digests
from lightning_seqpar.data.cached_rows import CachedRows
from lightning_seqpar.data.packing import OVERFLOW
from lightning_seqpar.data.step_batches import StepBatches, loader_place
from lightning_seqpar.data.supervised import template_identity
from lightning_seqpar.data.supervised_cache import (
    CACHE_VERSION, SupervisedCache, damage, is_cache, open_cache, wait_for_cache, write_cache,
)
from lightning_seqpar.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


class FineTuneDataModule(pl.LightningDataModule):
    """Supervised examples (:mod:`~lightning_seqpar.data.supervised`) in rows of ``block_size`` tokens
    (:mod:`~lightning_seqpar.data.packing`), batched so each micro-batch knows its optimizer step's supervised-token
    count (:mod:`~lightning_seqpar.data.step_batches`).

    The records are rendered once, by each node's local rank 0 in ``setup`` in one streaming pass (the node's other
    ranks wait while it makes progress), into a cache beside the data (or in ``cache_dir``): the directory
    ``FILE.sft-<key>`` (:mod:`~lightning_seqpar.data.supervised_cache`), published atomically. Its key and its
    ``meta.json`` record the tokenizer's identity and the chat template's hash, so a cache made with another
    tokenizer or template is never read; its digests are checked before it is read, and a damaged cache is prepared
    again with a warning. The tail ``val_fraction`` of the records (at least one) is the validation split.

    Args:
        path: a ``.jsonl`` file, one record per line (``{"messages": [...]}``, ``{"prompt", "completion"}`` or
            ``{"text"}``), or a cache directory prepared from one (read as it is: refused when damaged).
        tokenizer: a Hugging Face tokenizer directory or name, or a tokenizer object
            (:class:`~lightning_seqpar.data.tokenizer.Tokenizer`).
        block_size: s, tokens per row.
        batch_size: rows per data-parallel rank and micro-batch (b).
        packing: several examples per row (position ids restarting at each), or one per row, padded.
        overflow: an example longer than ``block_size``: ``"refuse"`` (before training) or ``"truncate"``.
        val_fraction: share of the records held out.
        seed: the rows' order each epoch is a permutation seeded by ``seed + epoch``.
        cache_dir: where the cache goes (default: beside the data).
        stall_timeout: seconds the other ranks wait for the cache without it making progress.
        progress: a progress bar while the cache is prepared (on a terminal).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``overflow`` or ``val_fraction`` out of range; from the reading, rendering and packing (a line
            that is not UTF-8 or JSON, a record the tokenizer cannot render, an example too long: naming the file and
            line), before training.
    """

    def __init__(self, path: str, tokenizer: Union[str, Tokenizer], block_size: int = 512, batch_size: int = 4,
                 packing: bool = True, overflow: str = "refuse", val_fraction: float = 0.05, seed: int = 0,
                 cache_dir: Optional[str] = None, stall_timeout: float = 300.0, progress: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        if not (self.path.is_file() or is_cache(self.path)):
            raise FileNotFoundError(f"No data at {self.path} (a .jsonl file of records, or a cache prepared from one).")
        if overflow not in OVERFLOW:
            raise ValueError(f"data.overflow={overflow!r}: one of {OVERFLOW}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.block_size, self.batch_size, self.packing, self.overflow = block_size, batch_size, packing, overflow
        self.val_fraction, self.seed, self.stall_timeout, self.progress = val_fraction, seed, stall_timeout, progress
        self._checked: dict[tuple[int, int], Optional[str]] = {}  # a published cache's digest check, by its meta's stat
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.vocab_size = self.tokenizer.vocab_size
        self.cache: Optional[SupervisedCache] = None  # memory maps: a rank holds an index of rows, not the rows

    def cache_path(self) -> Path:
        """The cache directory of the data: the data path itself when it is one, else ``FILE.sft-<key>`` beside the
        file (or in ``cache_dir``), keyed by tokenizer and template."""
        if self.path.is_dir():
            return self.path
        key = f"{self.tokenizer.identity}-{template_identity(self.tokenizer) or 'notemplate'}"
        return (self.cache_dir or self.path.parent) / f"{self.path.name}.sft-{key}"

    def _identity(self) -> dict:
        """What the cache depends on: the file by content (not size and time), the tokenizer and its template."""
        return {"source": str(self.path.resolve()), "source_bytes": self.path.stat().st_size,
                "source_sha256": content_digest(self.path), "tokenizer": self.tokenizer.identity,
                "chat_template": template_identity(self.tokenizer)}

    def _matches(self, path: Path) -> bool:
        """Whether ``path`` holds a cache of this file, tokenizer and template (its content is checked apart)."""
        if not is_cache(path):
            return False
        meta = json.loads((path / "meta.json").read_text())
        return meta.get("version") == CACHE_VERSION and all(meta.get(k) == v for k, v in self._identity().items())

    def _damage(self, path: Path) -> Optional[str]:
        """What is wrong with the matching cache at ``path`` (``None``: it passes its digests); checked once per
        published cache."""
        stamp = (path / "meta.json").stat()
        key = (stamp.st_ino, stamp.st_mtime_ns)
        if key not in self._checked:
            self._checked[key] = damage(path)
        return self._checked[key]

    def prepare_cache(self) -> Path:
        """Render the data into its cache unless a whole one of this file, tokenizer and template exists (a damaged
        one is prepared again, with a warning); one process per node calls it. Returns the cache directory."""
        path = self.cache_path()
        why = "no cache yet" if not self._matches(path) else self._damage(path)
        if why is not None:
            if why != "no cache yet":
                log.warning("The fine-tuning cache %s is damaged (%s): prepared again from %s.", path, why, self.path)
            write_cache(self.path, self.tokenizer, path, self._identity(), self.progress)
        return path

    def load_cache(self) -> SupervisedCache:
        """The rendered examples' cache (memory maps), made (local rank 0) or waited for (the others) first.

        Raises:
            ValueError: the data path is a cache directory that is damaged or was made with another tokenizer or
                template, naming it.
            TimeoutError: local rank 0 made no progress on the cache for ``stall_timeout`` seconds.
        """
        path = self.cache_path()
        if path == self.path:  # given directly: there is no source to prepare it again from
            cache = open_cache(path)
            made = {k: cache.meta.get(k) for k in ("tokenizer", "chat_template")}
            ours = {"tokenizer": self.tokenizer.identity, "chat_template": template_identity(self.tokenizer)}
            if made != ours:
                raise ValueError(f"The fine-tuning cache {path} was made with tokenizer {made['tokenizer']} and chat "
                                 f"template {made['chat_template'] or 'none'}; this run's are {ours['tokenizer']} and "
                                 f"{ours['chat_template'] or 'none'}. Give the .jsonl file to prepare it again.")
            return cache
        if self.trainer is not None:  # hashed by one rank for the cache's identity, the digest sent to the others
            spread_digests([self.path])
        if self.trainer is None or self.trainer.local_rank == 0:
            self.prepare_cache()
        else:
            wait_for_cache(path, lambda p: self._matches(p) and self._damage(p) is None, self.stall_timeout)
        return open_cache(path, verified=self._damage(path) is None)  # digests read once per cache

    def _rows(self, first: int, last: int) -> CachedRows:
        assert self.cache is not None
        return CachedRows(self.cache, first, last, self.block_size, int(self.tokenizer.separator[-1]), self.packing,
                          self.overflow, lambda i: f"{self.path}: record {i + 1}")

    def setup(self, stage: Optional[str] = None) -> None:
        """Render (or read) the examples, check their ids against the model, and make the rows.

        Raises:
            ValueError: an id at or above the model's vocabulary (another tokenizer's data), naming both; a split
                with no supervised token (its mean loss would be 0), naming the file and the records.
        """
        if self.cache is None:
            self.cache = self.load_cache()
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab = getattr(module, "vocab_size", None)
        records = len(self.cache.lengths)
        largest = int(self.cache.meta["max_id"])  # recorded when the cache was made: the ids are not read
        if vocab is not None and largest >= vocab:
            raise ValueError(f"{self.path} rendered to token id {largest}, but the model's vocabulary has {vocab} ids: "
                             f"the tokenizer ({self.tokenizer.name}) is not the model's. Use the model's tokenizer "
                             f"(data.tokenizer=null reads the model directory's).")
        held_out = max(1, int(records * self.val_fraction))
        split = records - held_out
        if split < 1:
            raise ValueError(f"{self.path} holds {records} record(s): too few to hold out validation.")
        self.train_rows, self.val_rows = self._rows(0, split), self._rows(split, records)
        splits = (("training", self.train_rows, 1, split), ("validation", self.val_rows, split + 1, records))
        for name, rows, first, last in splits:
            if int(rows.supervised.sum()) == 0:  # a mean over no token: loss 0, perplexity 1, nothing learnt
                raise ValueError(f"{self.path}: the {name} split (records {first}-{last}) has no supervised token: "
                                 f"every assistant turn or completion in it is empty (or truncated away). Give those "
                                 f"records content to learn, or fix the data's format.")

    def train_dataloader(self) -> DataLoader:
        """This rank's micro-batches (a ``StatefulDataLoader``: resuming mid-epoch continues with the next one)."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        replicas, rank, accumulate = loader_place(self.trainer)
        seed = self.seed + int(os.environ.get("PL_GLOBAL_SEED", 0))
        batches = StepBatches(self.train_rows, self.batch_size, replicas, rank, accumulate, seed)
        return StatefulDataLoader(batches, batch_size=None, sampler=batches.sampler())

    def val_dataloader(self) -> DataLoader:
        """The held-out rows in order, one micro-batch per validation step (``num_items_in_step``: that step's
        supervised tokens on every data-parallel rank); the loader's :meth:`StepBatches.supervised_in` gives the
        tokens of the batches a (possibly limited) validation runs."""
        replicas, rank, _ = loader_place(self.trainer)
        batch = min(self.batch_size, max(1, len(self.val_rows) // replicas))
        batches = StepBatches(self.val_rows, batch, replicas, rank, 1, self.seed, shuffle=False, split="validation")
        return DataLoader(batches, batch_size=None, sampler=batches.sampler())

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])
