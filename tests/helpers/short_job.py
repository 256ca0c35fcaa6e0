"""A complete two-process job of two steps, launched the default way (popen): ``python tests/helpers/short_job.py``."""

import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_seqpar import SeqParallelStrategy  # noqa: E402
from tests.helpers.models import build, loader, token_data  # noqa: E402

if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=SeqParallelStrategy(tp=2), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(build("gpt"), loader(token_data(2, 1)))
    print("done", trainer.global_rank, flush=True)
