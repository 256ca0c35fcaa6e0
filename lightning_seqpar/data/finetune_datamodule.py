"""The fine-tuning data module: JSON Lines of conversations, prompt/completion pairs or texts, as supervised rows."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.data.packing import OVERFLOW, Rows, pack_examples
from lightning_seqpar.data.step_batches import StepBatches
from lightning_seqpar.data.supervised import SupervisedExample, render_record, template_identity
from lightning_seqpar.data.tokenizer import Tokenizer, load_tokenizer

CACHE_VERSION = 1


class FineTuneDataModule(pl.LightningDataModule):
    """Supervised examples (:mod:`~lightning_seqpar.data.supervised`) in rows of ``block_size`` tokens
    (:mod:`~lightning_seqpar.data.packing`), batched so each micro-batch knows its optimizer step's supervised-token
    count (:mod:`~lightning_seqpar.data.step_batches`).

    The records are rendered once, by each node's local rank 0 in ``setup`` (the node's other ranks wait for the
    file), into a cache beside the data (or in ``cache_dir``): ``FILE.sft-<key>.npz``, written atomically. Its key
    and its ``meta`` record the tokenizer's identity, the chat template's hash, the formats found and the tokens
    supervised, so a cache made with another tokenizer or template is never read. The tail ``val_fraction`` of the
    records (at least one) is the validation split.

    Args:
        path: a ``.jsonl`` file, one record per line (``{"messages": [...]}``, ``{"prompt", "completion"}`` or
            ``{"text"}``).
        tokenizer: a Hugging Face tokenizer directory or name, or a tokenizer object
            (:class:`~lightning_seqpar.data.tokenizer.Tokenizer`).
        block_size: s, tokens per row.
        batch_size: rows per data-parallel rank and micro-batch (b).
        packing: several examples per row (position ids restarting at each), or one per row, padded.
        overflow: an example longer than ``block_size``: ``"refuse"`` (before training) or ``"truncate"``.
        val_fraction: share of the records held out.
        seed: the rows' order each epoch is a permutation seeded by ``seed + epoch``.
        cache_dir: where the cache goes (default: beside the data).
        stall_timeout: seconds the other ranks wait for the cache.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``overflow`` or ``val_fraction`` out of range; from the rendering and packing (a record the
            tokenizer cannot render, an example too long), before training.
    """

    def __init__(self, path: str, tokenizer: Union[str, Tokenizer], block_size: int = 512, batch_size: int = 4,
                 packing: bool = True, overflow: str = "refuse", val_fraction: float = 0.05, seed: int = 0,
                 cache_dir: Optional[str] = None, stall_timeout: float = 300.0) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"No data at {self.path} (a .jsonl file of records).")
        if overflow not in OVERFLOW:
            raise ValueError(f"data.overflow={overflow!r}: one of {OVERFLOW}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.block_size, self.batch_size, self.packing, self.overflow = block_size, batch_size, packing, overflow
        self.val_fraction, self.seed, self.stall_timeout = val_fraction, seed, stall_timeout
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.vocab_size = self.tokenizer.vocab_size
        self.examples: Optional[list[SupervisedExample]] = None

    def cache_path(self) -> Path:
        key = f"{self.tokenizer.identity}-{template_identity(self.tokenizer) or 'notemplate'}"
        return (self.cache_dir or self.path.parent) / f"{self.path.name}.sft-{key}.npz"

    def render(self) -> list[SupervisedExample]:
        """Every record, rendered (raises on the first that cannot be)."""
        examples = []
        with self.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    examples.append(render_record(json.loads(line), self.tokenizer, f"{self.path}:{number}"))
        if not examples:
            raise ValueError(f"{self.path} holds no records.")
        return examples

    def _write_cache(self, path: Path) -> None:
        examples = self.render()
        lengths = np.asarray([len(e) for e in examples], dtype=np.int64)
        meta = {"version": CACHE_VERSION, "source": str(self.path.resolve()), "source_bytes": self.path.stat().st_size,
                "source_mtime_ns": self.path.stat().st_mtime_ns, "tokenizer": self.tokenizer.identity,
                "chat_template": template_identity(self.tokenizer), "examples": len(examples),
                "tokens": int(lengths.sum()), "supervised": int(sum(int(e.supervised.sum()) for e in examples))}
        tmp = temporary_path(path)  # published whole: a reader never sees a partial cache
        with open(tmp, "wb") as handle:
            np.savez(handle, ids=np.concatenate([e.ids for e in examples]),
                     supervised=np.concatenate([e.supervised for e in examples]), lengths=lengths,
                     meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        publish(tmp, path)

    def _fresh(self, path: Path) -> bool:
        if not path.is_file():
            return False
        with np.load(path) as cache:
            meta = json.loads(bytes(cache["meta"]).decode())
        stat = self.path.stat()
        return meta.get("version") == CACHE_VERSION and meta["source_bytes"] == stat.st_size and \
            meta["source_mtime_ns"] == stat.st_mtime_ns

    def load_examples(self) -> list[SupervisedExample]:
        """The rendered examples from the cache, made (local rank 0) or waited for (the others) first."""
        path = self.cache_path()
        if self.trainer is None or self.trainer.local_rank == 0:
            if not self._fresh(path):
                self._write_cache(path)
        else:
            start = time.monotonic()
            while not self._fresh(path):
                if time.monotonic() - start > self.stall_timeout:
                    raise TimeoutError(f"{path} was not written within {self.stall_timeout:g} s by local rank 0.")
                time.sleep(0.2)
        with np.load(path) as cache:
            ids, supervised, lengths = cache["ids"], cache["supervised"], cache["lengths"]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [SupervisedExample(ids[a:b], supervised[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def _rows(self, examples: list[SupervisedExample], first: int) -> Rows:
        names = [f"{self.path}: record {first + i + 1}" for i in range(len(examples))]
        pad = int(self.tokenizer.separator[-1])
        return pack_examples(examples, self.block_size, pad, self.packing, self.overflow, names)

    def setup(self, stage: Optional[str] = None) -> None:
        """Render (or read) the examples, check their ids against the model, and make the rows.

        Raises:
            ValueError: an id at or above the model's vocabulary (another tokenizer's data), naming both; a split
                with no supervised token (its mean loss would be 0), naming the file and the records.
        """
        if self.examples is None:
            self.examples = self.load_examples()
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab = getattr(module, "vocab_size", None)
        largest = max(int(e.ids.max()) for e in self.examples)
        if vocab is not None and largest >= vocab:
            raise ValueError(f"{self.path} rendered to token id {largest}, but the model's vocabulary has {vocab} ids: "
                             f"the tokenizer ({self.tokenizer.name}) is not the model's. Use the model's tokenizer "
                             f"(data.tokenizer=null reads the model directory's).")
        held_out = max(1, int(len(self.examples) * self.val_fraction))
        split = len(self.examples) - held_out
        if split < 1:
            raise ValueError(f"{self.path} holds {len(self.examples)} record(s): too few to hold out validation.")
        self.train_rows = self._rows(self.examples[:split], 0)
        self.val_rows = self._rows(self.examples[split:], split)
        splits = (("training", self.train_rows, 1, split), ("validation", self.val_rows, split + 1, len(self.examples)))
        for name, rows, first, last in splits:
            if int(rows.supervised.sum()) == 0:  # a mean over no token: loss 0, perplexity 1, nothing learnt
                raise ValueError(f"{self.path}: the {name} split (records {first}-{last}) has no supervised token: "
                                 f"every assistant turn or completion in it is empty (or truncated away). Give those "
                                 f"records content to learn, or fix the data's format.")

    def _place(self) -> tuple[int, int, int]:
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        replicas, rank = (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        return replicas, rank, accumulate

    def train_dataloader(self) -> DataLoader:
        """This rank's micro-batches (a ``StatefulDataLoader``: resuming mid-epoch continues with the next one)."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        replicas, rank, accumulate = self._place()
        seed = self.seed + int(os.environ.get("PL_GLOBAL_SEED", 0))
        batches = StepBatches(self.train_rows, self.batch_size, replicas, rank, accumulate, seed)
        return StatefulDataLoader(batches, batch_size=None, sampler=batches.sampler())

    def val_dataloader(self) -> DataLoader:
        """The held-out rows in order, one micro-batch per validation step: ``num_items_in_step`` counts the
        supervised tokens of that micro-batch on every data-parallel rank, so a validation stopped early
        (``limit_val_batches``) divides by the tokens it saw."""
        replicas, rank, _ = self._place()
        batch = min(self.batch_size, max(1, len(self.val_rows) // replicas))
        batches = StepBatches(self.val_rows, batch, replicas, rank, 1, self.seed, shuffle=False, split="validation")
        return DataLoader(batches, batch_size=None, sampler=batches.sampler())

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])
