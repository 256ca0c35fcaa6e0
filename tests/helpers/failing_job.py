"""A two-process job (popen) in which one rank fails while the other is in a long wait of its own (not a
collective): ``python tests/helpers/failing_job.py RANK``."""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_seqpar import SeqParallelStrategy  # noqa: E402
from tests.helpers.models import build, loader, token_data  # noqa: E402


class FailOnOneRank(pl.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank:
            raise RuntimeError(f"the data of rank {self.rank} cannot be read")
        time.sleep(120)  # e.g. waiting for a file another rank writes


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=SeqParallelStrategy(tp=2), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[FailOnOneRank(int(sys.argv[1]))])
    trainer.fit(build("gpt"), loader(token_data(2, 1)))
