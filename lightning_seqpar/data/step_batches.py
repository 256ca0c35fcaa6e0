"""Micro-batches that know their optimizer step's supervised-token count, so the loss is one process's mean.

Fine-tuning data supervises a varying number of tokens per row (assistant turns only, padding), so the mean loss of
each micro-batch, averaged over micro-batches and data-parallel ranks, is not the mean over the step's supervised
tokens that one process would compute over the same global batch. Each micro-batch here carries
``num_items_in_step`` (``[b]``, every entry the count of supervised tokens in the whole optimizer step: every
data-parallel rank's rows, every accumulated micro-batch), read from the same seeded permutation every rank computes,
so no rank communicates for it. The module divides its loss sum by ``num_items_in_step / replicas``, ``replicas``
being the losses averaged into one step's gradient (:func:`~lightning_seqpar.lightning.loss_average.loss_replicas`).

Order: each epoch a permutation of the rows seeded by ``seed + epoch`` (the same on every rank; Lightning calls
:meth:`StepSampler.set_epoch`); step j takes the next ``d · a · b`` rows (``d`` data-parallel ranks, ``a`` accumulated
micro-batches of ``b`` rows), micro-batch ``m`` of rank ``q`` the ``b`` rows at ``((j·a + m)·d + q)·b``; an incomplete
last step is dropped. A resumed epoch counts its steps from the global row the checkpoint's run had
reached
(:class:`StepSampler`), whatever d, a and b were then.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_seqpar.data.packing import Rows

log = logging.getLogger(__name__)


def loader_place(trainer: Any) -> tuple[int, int, int]:
    """``(d, this rank's data-parallel index, a)`` of a data module's trainer (``(1, 0, 1)`` without one)."""
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    replicas, rank = (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)
    accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
    return replicas, rank, accumulate


class StepSampler(DistributedSampler):
    """Yields ``(epoch, k, offset)``: micro-batch ``k`` of this rank in ``epoch``, counted from global row ``offset``
    of the epoch's order (0, or where a resumed run continues; see the module docstring).

    A ``DistributedSampler`` by type only (none of its splitting is used): Lightning wraps any other sampler of a
    distributed run so that each rank takes every d-th of its indices, which would split this rank's own
    micro-batches again. Its saved position (:meth:`state_dict`, kept by torchdata's ``StatefulDataLoader`` in the
    checkpoint) is the global row of the epoch, so a resume at another data-parallel size, batch or accumulation
    continues at the same row (:mod:`~lightning_seqpar.data.global_order` for the pretraining corpus).
    """

    def __init__(self, batches: "StepBatches") -> None:
        super().__init__(range(len(batches)), num_replicas=1, rank=0, shuffle=False)
        self.micro_batches, self.epoch = len(batches), 0
        self.rows, self.seed, self.rank = len(batches.rows), batches.seed, batches.rank
        self.micro_rows = batches.d * batches.b  # global rows one micro-batch index covers on all ranks
        self.global_batch = batches.d * batches.a * batches.b
        self._resume_epoch, self._resume_at = -1, 0
        self._epoch_started, self._started_at, self._yielded = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.micro_batches

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        # The first pass after a resume continues the saved epoch's order from its row, whatever epoch Lightning
        # counts (a checkpoint written at the end of a max_steps run counts its epoch as finished); then fresh epochs.
        epoch, offset = (self._resume_epoch, self._resume_at) if self._resume_epoch >= 0 else (self.epoch, 0)
        self._resume_epoch, self._resume_at = -1, 0
        # From the start, the batches' own count (a loader that covers every row wraps its last step); a resumed
        # pass: the whole steps left after the restored row (an incomplete last one is dropped).
        micro = self.micro_batches if offset == 0 else (
            (self.rows - offset) // self.global_batch * (self.global_batch // self.micro_rows))
        self._epoch_started, self._started_at, self._yielded = epoch, offset, 0
        for k in range(micro):
            self._yielded += 1
            yield epoch, k, offset

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "global_row", "seed", "rows", "global_batch"}``: the rows of the epoch consumed by every rank."""
        return {"epoch": self._epoch_started, "global_row": self._started_at + self._yielded * self.micro_rows,
                "seed": self.seed, "rows": self.rows, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s global row when its epoch starts; another data set (rows or seed) starts that
        epoch again, another global batch continues at the same row: each said in one line (rank 0)."""
        same_data = state["rows"] == self.rows and state["seed"] == self.seed
        self._resume_epoch, self._resume_at = (state["epoch"], state["global_row"]) if same_data else (-1, 0)
        if self.rank != 0:
            return
        if not same_data:
            log.warning(f"resume: the checkpoint's data position is of {state['rows']} rows with seed "
                        f"{state['seed']}, this run has {self.rows} with seed {self.seed}: epoch {state['epoch']} "
                        f"starts again from its first row.")
        elif state["global_batch"] != self.global_batch:
            log.warning(f"resume: continuing at global row {state['global_row']} of epoch {state['epoch']} with a "
                        f"global batch of {self.global_batch} rows per optimizer step (the checkpoint's run took "
                        f"{state['global_batch']}): the same rows follow, grouped into other steps.")


class StepBatches(Dataset):
    """This rank's micro-batches of ``rows``, each a dict of ``[b, s]`` tensors (``input_ids``, ``labels``, and
    ``position_ids`` when packed, else ``attention_mask``) and ``num_items_in_step`` ``[b]``.

    Raises:
        ValueError: fewer rows than one optimizer step takes (``d · a · b``), naming the numbers.
    """

    def __init__(self, rows: Rows, batch_size: int, replicas: int, rank: int, accumulate: int, seed: int,
                 shuffle: bool = True, split: str = "training") -> None:
        self.rows, self.b, self.d, self.rank, self.a = rows, batch_size, replicas, rank, accumulate
        self.seed, self.shuffle = seed, shuffle
        self.steps = len(rows) // (replicas * accumulate * batch_size)
        if self.steps == 0:
            raise ValueError(f"The {split} split has {len(rows)} rows, fewer than one optimizer step takes: "
                             f"{replicas} data-parallel ranks × {accumulate} accumulated micro-batches × {batch_size} "
                             f"rows. Use more data, a smaller data.batch_size, or a smaller val_fraction.")
        self.counts = rows.supervised

    def __len__(self) -> int:
        return self.steps * self.a

    def supervised_in(self, micro_batches: float) -> int:
        """Supervised tokens of the first ``micro_batches`` micro-batches of epoch 0 on every rank (the whole epoch
        when more, ``inf`` included): what a validation that runs that many batches is a mean over. One micro-batch
        per step (``accumulate`` 1, as validation runs).

        Raises:
            ValueError: accumulated micro-batches (a step's count would be split between micro-batches).
        """
        if self.a != 1:
            raise ValueError(f"supervised_in counts whole steps; this loader accumulates {self.a} micro-batches.")
        steps = int(min(micro_batches, len(self)))
        return int(self.counts[self._order(0)[:steps * self.d * self.b]].sum())

    def sampler(self) -> StepSampler:
        return StepSampler(self)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=generator).numpy()

    def placed(self, index: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(rows of micro-batch index's step, this rank's b rows of it)`` for ``index = (epoch, k)`` or
        ``(epoch, k, offset)`` (steps counted from global row ``offset`` of the epoch's order; a step that runs past
        the end wraps around to the epoch's first rows)."""
        epoch, k = index[0], index[1]
        offset = index[2] if len(index) > 2 else 0
        order = self._order(epoch)
        step, micro = divmod(k, self.a)
        per_step = self.d * self.a * self.b
        first = offset + step * per_step
        start = first + (micro * self.d + self.rank) * self.b
        whole = np.arange(first, first + per_step) % len(order)
        return order[whole], order[np.arange(start, start + self.b) % len(order)]

    def __getitem__(self, index: tuple[int, int]) -> dict[str, torch.Tensor]:
        in_step, mine = self.placed(index)
        total = int(self.counts[in_step].sum())
        input_ids, labels, second = self.rows.take(mine)  # read now: a rank holds no rows (data/cached_rows.py)
        batch = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                 "position_ids" if self.rows.packed else "attention_mask": torch.from_numpy(second)}
        batch["num_items_in_step"] = torch.full((self.b,), total, dtype=torch.long)
        return batch
