"""One order of the samples for every data-parallel size, and a position in it that resumes under any other.

Each epoch the dataset's N samples are permuted by ``seed + epoch`` (the same permutation whatever the number of
data-parallel ranks d); data-parallel rank q takes positions ``q, q + d, q + 2d, ...`` of it, so the union of the
ranks' k-th batches of b samples is positions ``[k·b·d, (k+1)·b·d)``: the global batch of a step is the same set of
samples at every d with the same ``b·d``. The position saved in a checkpoint is therefore global (samples of the epoch
consumed by all ranks together), and a run resumed at another d, b or accumulation continues at the same global
sample. Without a resume the order is ``torch.utils.data.DistributedSampler``'s (shuffled, padded by wrapping so that
every rank yields as many samples), sample for sample.

A ``DistributedSampler`` by type, so Lightning does not wrap it again; torchdata's ``StatefulDataLoader`` saves its
:meth:`GlobalOrderSampler.state_dict` with the loader's position (its batch iterator asks the sampler when the sampler
is ``Stateful``) and restores it before the resumed epoch's first batch.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler

log = logging.getLogger(__name__)


class GlobalOrderSampler(DistributedSampler):
    """This data-parallel rank's sample indices, in the global order of the module docstring.

    Args:
        dataset: the samples (only ``len`` is read).
        num_replicas: d, data-parallel ranks.
        rank: this rank's data-parallel index q.
        seed: the permutation's seed (epoch e uses ``seed + e``).
        global_batch: samples per optimizer step over every rank (``b · d · accumulation``): a resume under another
            global batch says so (it continues at the same sample, but its steps are not the saved run's).

    Raises:
        ValueError: from ``DistributedSampler`` (a rank outside ``[0, num_replicas)``).
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, global_batch: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.size = len(dataset)  # type: ignore[arg-type]
        self.global_batch = global_batch
        self._resume_epoch, self._resume_at = -1, 0  # a restored position, for that epoch only
        self._epoch_started, self._started_at, self._yielded = 0, 0, 0

    def order(self, epoch: int) -> list[int]:
        """Every sample index of ``epoch`` in the global order (``DistributedSampler``'s permutation)."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        # The first pass after a resume continues the saved epoch's order from its sample, whatever epoch Lightning
        # counts (a checkpoint written at the end of a max_steps run counts its epoch as finished); then fresh epochs.
        epoch, start = (self._resume_epoch, self._resume_at) if self._resume_epoch >= 0 else (self.epoch, 0)
        self._resume_epoch, self._resume_at = -1, 0
        rest = self.order(epoch)[start:]
        if not rest:
            return
        padding = -len(rest) % self.num_replicas  # wrap around so every rank yields as many (DistributedSampler)
        rest += (rest * (padding // len(rest) + 1))[:padding]
        self._epoch_started, self._started_at, self._yielded = epoch, start, 0
        for index in rest[self.rank::self.num_replicas]:
            self._yielded += 1
            yield index

    def position(self) -> int:
        """Samples of the current epoch consumed by every rank together (this rank's yielded count times d, from where
        the epoch's iteration started)."""
        return self._started_at + self._yielded * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "global_index", "seed", "size", "global_batch"}``: where the run stands in the global order."""
        return {"epoch": self._epoch_started, "global_index": self.position(), "seed": self.seed,
                "size": self.size, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s global sample when its epoch starts (a checkpoint of any data-parallel size).

        Another dataset size or seed makes the saved position meaningless: that epoch starts from its first sample,
        and the log says so; another global batch continues at the same sample, and the log says so."""
        if (state["size"] != self.size or state["seed"] != self.seed) and self.rank == 0:
            log.warning(f"resume: the checkpoint's data position is of {state['size']} samples with seed "
                        f"{state['seed']}, this run has {self.size} with seed {self.seed}: epoch {state['epoch']} "
                        f"starts again from its first sample.")
        if state["size"] != self.size or state["seed"] != self.seed:
            self._resume_epoch, self._resume_at = -1, 0
            return
        self._resume_epoch, self._resume_at = state["epoch"], state["global_index"]
        if state["global_batch"] != self.global_batch and self.rank == 0:
            log.warning(f"resume: continuing at global sample {state['global_index']} of epoch {state['epoch']} with "
                        f"a global batch of {self.global_batch} samples per optimizer step (the checkpoint's run took "
                        f"{state['global_batch']}): the same samples follow, grouped into other steps.")
