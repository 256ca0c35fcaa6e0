"""The recipe runs end to end on every corpus it documents and at any data-parallel size."""

import sys

import pytest
import numpy as np

from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _run(tmp_path, *overrides):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "pretrain_gpt.py"), "model=gpt_tiny", "trainer.log_every_n_steps=1",
           "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", "sample.max_new_tokens=8",
           f"hydra.run.dir={out}", *overrides]
    return run_job(cmd, tmp_path, timeout=400).stdout, out


def test_a_uint16_token_corpus_trains_validates_and_samples_ids(tmp_path):
    """nanoGPT's format with GPT-2-sized ids: sampling prints ids (no bytes to decode), the run exits 0."""
    ids = np.random.default_rng(0).integers(0, 50257, size=3000, dtype=np.uint16)
    ids[::97] = 50256  # the largest GPT-2 id occurs
    (tmp_path / "tokens.bin").write_bytes(ids.tobytes())
    stdout, _ = _run(tmp_path, f"data.path={tmp_path / 'tokens.bin'}", "data.vocab_size=50257", "trainer.max_steps=2",
                     "trainer.val_check_interval=2", "data.batch_size=2")
    sample = stdout.split("--- sample ---")[1].strip().splitlines()[0]
    assert sample.startswith("[") and len(sample.strip("[]").split()) == 8 + 8  # prompt ids + new ids
    assert all(0 <= int(i) < 50257 for i in sample.strip("[]").split())


def test_the_default_config_runs_at_dp_2_with_epochs_shorter_than_the_validation_interval(tmp_path):
    """tp 2 × dp 2: an epoch of 3 steps is shorter than val_check_interval=5; validation is counted in steps
    across epochs and a final validation runs after the last (unvalidated) step."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 40)  # 3800 bytes: 3 steps of 4 × 2 blocks of 32 (+1) per epoch
    stdout, out = _run(tmp_path, "trainer.devices=4", f"data.path={corpus}", "data.batch_size=4", "trainer.max_steps=7",
                       "trainer.val_check_interval=5", "data.val_fraction=0.1")
    metrics = next((out / "logs").rglob("metrics.csv")).read_text().splitlines()
    header = metrics[0].split(",")
    steps_with_val = [row.split(",")[header.index("step")] for row in metrics[1:]
                      if row.split(",")[header.index("val/loss")]]
    assert steps_with_val == ["4", "7"]  # inside fit after step 5 (logged 0-based), then trainer.validate at step 7
    assert (out / "checkpoints" / "step000005.ckpt").exists()
