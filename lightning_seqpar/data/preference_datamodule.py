"""The preference data module: JSON Lines of preference pairs (:mod:`~lightning_seqpar.data.preference`) in
micro-batches whose rows alternate chosen and rejected replies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_seqpar.data.packing import OVERFLOW
from lightning_seqpar.data.preference import (PackedPairRows, PairRows, PreferencePair, packed_pair_rows, pair_rows,
                                              render_pairs)
from lightning_seqpar.data.step_batches import StepBatches, loader_place
from lightning_seqpar.data.supervised_cache import read_records
from lightning_seqpar.data.tokenizer import Tokenizer, load_tokenizer


class PairBatches(StepBatches):
    """This rank's micro-batches of preference pairs: ``b`` pairs as ``[2b, s]`` rows (``input_ids``, ``labels``,
    ``attention_mask``; row ``2i`` chosen, ``2i+1`` rejected), ``num_items_in_step`` ``[2b]`` (the optimizer step's
    pairs, every data-parallel rank and accumulated micro-batch), ``pair_index`` ``[2b]`` (each row's pair in the
    split, for a reference pass) and, with reference log-probabilities, ``reference_logps`` ``[2b]`` float64.
    Order and placement as :class:`~lightning_seqpar.data.step_batches.StepBatches` (pairs in place of rows); with
    ``cover`` the last step wraps around to the first pairs, so every pair is in some batch (a reference pass).

    Packed rows (:class:`~lightning_seqpar.data.preference.PackedPairRows`): ``b`` rows of whole pairs, ``input_ids``,
    ``labels``, ``position_ids`` ``[b, s]``, ``sum_per_document`` ``[b, s, 2K]`` bool (token j belongs to reply slot
    d: what the model's loss sums per reply, :class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`), ``pair_index``
    ``[b, K]`` (``-1``: an empty slot), ``num_items_in_step`` ``[b]`` (the step's pairs) and ``reference_logps``
    ``[b, 2K]`` (0 in empty slots)."""

    def __init__(self, rows: Union[PairRows, PackedPairRows], batch_size: int, replicas: int, rank: int,
                 accumulate: int, seed: int,
                 shuffle: bool = True, split: str = "training", reference: Optional[np.ndarray] = None,
                 cover: bool = False) -> None:
        if not cover:
            super().__init__(rows, batch_size, replicas, rank, accumulate, seed, shuffle, split)
        else:  # every pair at least once: the last step wraps around to the first pairs
            self.rows, self.b, self.d, self.rank, self.a = rows, batch_size, replicas, rank, accumulate
            self.seed, self.shuffle, self.counts = seed, shuffle, rows.supervised
            self.steps = -(-len(rows) // (replicas * accumulate * batch_size))
        self.reference = reference

    def __getitem__(self, index: tuple[int, int]) -> dict[str, torch.Tensor]:
        if isinstance(self.rows, PackedPairRows):
            return self._packed(index)
        in_step, mine = self.placed(index)
        rows: PairRows = self.rows
        s = rows.input_ids.shape[-1]
        batch = {name: torch.from_numpy(getattr(rows, name)[mine].reshape(2 * self.b, s))
                 for name in ("input_ids", "labels", "attention_mask")}
        batch["num_items_in_step"] = torch.full((2 * self.b,), len(in_step), dtype=torch.long)
        batch["pair_index"] = torch.from_numpy(np.repeat(mine, 2).astype(np.int64))
        if self.reference is not None:
            batch["reference_logps"] = torch.from_numpy(self.reference[mine].reshape(2 * self.b))
        return batch

    def _packed(self, index: tuple[int, int]) -> dict[str, torch.Tensor]:
        in_step, mine = self.placed(index)
        rows: PackedPairRows = self.rows
        index = rows.pair_index[mine]
        width = 2 * index.shape[1]
        batch = {"input_ids": torch.from_numpy(rows.input_ids[mine]), "labels": torch.from_numpy(rows.labels[mine]),
                 "position_ids": torch.from_numpy(rows.position_ids[mine]),
                 "sum_per_document": torch.from_numpy(rows.slots[mine])[..., None] == torch.arange(width),
                 "pair_index": torch.from_numpy(index),
                 "num_items_in_step": torch.full((self.b,), int(self.counts[in_step].sum()), dtype=torch.long)}
        if self.reference is not None:
            values = self.reference[np.maximum(index, 0)]  # [b, K, 2]: chosen, rejected
            values[index < 0] = 0.0
            batch["reference_logps"] = torch.from_numpy(values.reshape(self.b, width))
        return batch


class PreferenceDataModule(pl.LightningDataModule):
    """Preference pairs from a JSON Lines file, for DPO (:class:`~lightning_seqpar.models.finetune.FineTuneModule`
    with ``objective="dpo"``).

    Every rank reads and renders the file in ``setup`` (pair data sets are small next to pre-training corpora; the
    supervised fine-tuning module's streaming cache is not used). The tail ``val_fraction`` of the records (at least
    one pair) is the validation split. Micro-batches hold ``batch_size`` pairs (``2·batch_size`` rows).

    Args:
        path: a ``.jsonl`` file of preference records (formats: :mod:`~lightning_seqpar.data.preference`).
        tokenizer: a Hugging Face tokenizer directory or name, or a :class:`~lightning_seqpar.data.tokenizer.Tokenizer`.
        block_size: s, tokens per row (one reply per row, padded; or whole pairs, packed).
        batch_size: pairs per data-parallel rank and micro-batch; packed: rows of ``block_size`` tokens.
        overflow: a reply longer than ``block_size``: ``"refuse"`` (before training) or ``"truncate"``.
        val_fraction: share of the records held out.
        seed: the pairs' order each epoch is a permutation seeded by ``seed + epoch``.
        reference: the reference model's log-probabilities per pair, ``{"training": [pairs, 2], "validation":
            [pairs, 2]}`` float64 (chosen, rejected; :mod:`~lightning_seqpar.models.dpo_reference`), added to every
            batch as ``reference_logps``; ``None``: the module computes them (LoRA: adapters off).
        packing: pairs packed into rows of ``block_size`` tokens, each pair's replies side by side, attention kept to
            each reply (:func:`~lightning_seqpar.data.preference.packed_pair_rows`; TRL's ``padding_free``): no padding
            but a row's tail, and as many pairs a step as its rows hold.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``overflow`` or ``val_fraction`` out of range; in ``setup``: a line that is not UTF-8 or JSON, a
            record that is not a preference pair, a reply too long or with no supervised token, an id outside the
            model's vocabulary, reference log-probabilities of another length, a batch size (pairs) that the
            pipeline's micro-batches would cut; each naming the file, line and fix.
    """

    def __init__(self, path: str, tokenizer: Union[str, Tokenizer], block_size: int = 512, batch_size: int = 2,
                 overflow: str = "refuse", val_fraction: float = 0.05, seed: int = 0,
                 reference: Optional[dict[str, np.ndarray]] = None, packing: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"No preference data at {self.path} (a .jsonl file of pairs).")
        if overflow not in OVERFLOW:
            raise ValueError(f"data.overflow={overflow!r}: one of {OVERFLOW}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.block_size, self.batch_size, self.overflow = block_size, batch_size, overflow
        self.val_fraction, self.seed, self.reference, self.packing = val_fraction, seed, reference, packing
        self.pairs: Optional[list[PreferencePair]] = None
        self.reference_split: Optional[str] = None  # set by a reference pass (lightning_seqpar.models.dpo_reference)
        self.vocab_size = self.tokenizer.vocab_size

    def load_pairs(self) -> list[PreferencePair]:
        """Every record of the file as a pair, rendered in one batch (errors name the line)."""
        records, wheres = [], []
        for number, _, record in read_records(self.path):
            records.append(record)
            wheres.append(f"{self.path}:{number}")
        if len(records) < 2:
            raise ValueError(f"{self.path} holds {len(records)} preference record(s): too few to hold out validation.")
        self._wheres = wheres
        return render_pairs(records, self.tokenizer, wheres)

    def setup(self, stage: Optional[str] = None) -> None:
        """Render the pairs, check their ids against the model, and make the rows of both splits.

        Raises:
            ValueError: see the class docstring.
        """
        pipeline = getattr(self.trainer.strategy, "pipeline", None) if self.trainer is not None else None
        m = pipeline.config.num_microbatches if pipeline is not None else 1
        if self.batch_size % m:  # micro-batches are cut along rows: a pair's two rows must stay together
            raise ValueError(f"data.batch_size={self.batch_size} {'rows' if self.packing else 'pairs'} cannot be cut "
                             f"into num_microbatches={m} micro-batches of whole "
                             f"{'rows' if self.packing else 'pairs'}. Use a data.batch_size divisible by {m}.")
        if self.pairs is None:
            self.pairs = self.load_pairs()
        module = self.trainer.lightning_module if self.trainer is not None else None
        vocab = getattr(module, "vocab_size", None)
        largest = max(int(max(p.chosen.ids.max(), p.rejected.ids.max())) for p in self.pairs)
        if vocab is not None and largest >= vocab:
            raise ValueError(f"{self.path} rendered to token id {largest}, but the model's vocabulary has {vocab} ids: "
                             f"the tokenizer ({self.tokenizer.name}) is not the model's. Use the model's tokenizer.")
        held_out = max(1, int(len(self.pairs) * self.val_fraction))
        split = len(self.pairs) - held_out
        pad = int(self.tokenizer.separator[-1])
        make = packed_pair_rows if self.packing else pair_rows
        self.train_rows = make(self.pairs[:split], self.block_size, pad, self.overflow, self._wheres[:split])
        self.val_rows = make(self.pairs[split:], self.block_size, pad, self.overflow, self._wheres[split:])
        for name, rows in (("training", self.train_rows), ("validation", self.val_rows)):
            given = None if self.reference is None else self.reference.get(name)
            if given is not None and tuple(given.shape) != (rows.pairs, 2):
                raise ValueError(f"The reference log-probabilities of the {name} split have shape {tuple(given.shape)}, "
                                 f"but {self.path} gives {rows.pairs} pairs there: they were computed for other data "
                                 f"or another val_fraction. Compute them again for this data.")

    def _reference(self, split: str) -> Optional[np.ndarray]:
        return None if self.reference is None else self.reference.get(split)

    def train_dataloader(self) -> DataLoader:
        """This rank's micro-batches (a ``StatefulDataLoader``: resuming mid-epoch continues with the next one)."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        replicas, rank, accumulate = loader_place(self.trainer)
        seed = self.seed + int(os.environ.get("PL_GLOBAL_SEED", 0))
        batches = PairBatches(self.train_rows, self.batch_size, replicas, rank, accumulate, seed,
                              reference=self._reference("training"))
        return StatefulDataLoader(batches, batch_size=None, sampler=batches.sampler())

    def val_dataloader(self) -> DataLoader:
        """The held-out pairs in order, one micro-batch per validation step (an incomplete last step is dropped);
        during a reference pass (``reference_split`` set), every pair of that split in order instead."""
        replicas, rank, _ = loader_place(self.trainer)
        if self.reference_split is not None:
            rows = self.train_rows if self.reference_split == "training" else self.val_rows
            batches = PairBatches(rows, self.batch_size, replicas, rank, 1, self.seed, shuffle=False, cover=True)
            return DataLoader(batches, batch_size=None, sampler=batches.sampler())
        rows, batch = self.val_rows, min(self.batch_size, max(1, len(self.val_rows) // replicas))
        if isinstance(rows, PackedPairRows):  # whole batches (a pipeline cuts them), empty rows after the last pair
            rows, batch = rows.with_rows(self.batch_size * replicas, int(self.tokenizer.separator[-1])), self.batch_size
        batches = PairBatches(rows, batch, replicas, rank, 1, self.seed, shuffle=False, split="validation",
                              reference=self._reference("validation"))
        return DataLoader(batches, batch_size=None, sampler=batches.sampler())

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])
