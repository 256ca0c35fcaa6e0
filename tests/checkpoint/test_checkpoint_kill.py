"""A job killed with SIGKILL while it saves leaves the last complete checkpoint loadable: once at a random moment,
then twice the moment a save is half-written (its temporary folder exists), the case the atomic publish is for."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from lightning_seqpar.checkpoint import consolidate, is_sharded_checkpoint
from lightning_seqpar.checkpoint.atomic import recover_stale
from tests.helpers.jobs import kill_session, start_recipe

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

KILLS = 3
PARTIAL = (".tmp-", ".old-", ".del-")  # a save, a replacement or a removal under way


def _published(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith(".")) if directory.is_dir() else []


def test_kill_9_during_saves_never_leaves_a_partial_checkpoint(tmp_path):
    rng = random.Random(0)
    checkpoints = tmp_path / "out" / "checkpoints"
    seen_partial = 0
    for attempt in range(KILLS):
        # A checkpoint every step (two per step: the latest and last.ckpt), so most of the job's time is saving.
        # Each job after the first resumes from the last.ckpt its predecessor left (after recovery).
        resume = [f"ckpt_path={checkpoints / 'last.ckpt'}"] if attempt else []
        job, log = start_recipe(tmp_path, "model=gpt_tiny", "model.n_embd=256", "model.n_layer=4",
                                "trainer.max_steps=100000", "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
                                "trainer.enable_progress_bar=false", "recompute.granularity=none", *resume)
        try:
            deadline = time.time() + 180
            while not is_sharded_checkpoint(checkpoints / "last.ckpt") or attempt and not _newer(checkpoints, job):
                assert job.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            if attempt == 0:
                time.sleep(rng.uniform(0.0, 1.5))
            else:  # the next save half-written
                while not any(mark in p.name for p in checkpoints.iterdir() for mark in PARTIAL):
                    assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                    time.sleep(0.005)
        finally:
            kill_session(job)
        seen_partial += any(mark in p.name for p in checkpoints.iterdir() for mark in PARTIAL)
        recover_stale(checkpoints)  # what the next save or load does first
        assert not any(p.name.startswith(".") for p in checkpoints.iterdir())
        published = _published(checkpoints)
        assert checkpoints / "last.ckpt" in published
        for checkpoint in published:  # every published name is complete: each tensor of each rank reads back
            assert is_sharded_checkpoint(checkpoint), checkpoint
            assert consolidate(checkpoint)["gpt.transformer.wte.weight"].shape == (256, 256)
    assert seen_partial >= 1  # a kill did land mid-save (a targeted one can still lose the race with the save)


def _newer(checkpoints: Path, job) -> bool:
    """Whether this job has published a last.ckpt of its own."""
    marker = checkpoints / "last.ckpt" / "trainer_state.pt"
    return marker.exists() and marker.stat().st_mtime > job.started
