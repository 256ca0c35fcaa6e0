"""``Trainer.fit`` called from this (pytest) process spawns the ranks and gets the trained model back."""

import sys

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.jobs import ROOT, run_job
from tests.helpers.models import build, loader, reference_run, token_data
from tests.helpers.parity import STEPS
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def fit_and_compare(start_method: str) -> None:
    """Fit from this process with ``start_method`` and check the model it gets back against one process."""
    module = build("gpt")
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy_of(tp=2, start_method=start_method),
        precision="64-true", max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, loader(token_data(STEPS, 1)))

    ref = reference_run(build("gpt"), token_data(STEPS, 1), STEPS, 1)
    state = module.state_dict()
    assert state.keys() == ref.final_state.keys()
    assert all(not torch.equal(state[name], initial[name]) for name in state if "weight" in name)
    for name, want in ref.final_state.items():
        torch.testing.assert_close(state[name].double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # sync_dist-logged metrics travel back too.
    torch.testing.assert_close(trainer.callback_metrics["train/loss"].double(),
                               torch.tensor(ref.losses[-1], dtype=torch.float64), rtol=1e-6, atol=0)


def test_spawned_ranks_return_the_trained_unparallelized_model():
    fit_and_compare("spawn")


def test_forked_ranks_return_the_trained_unparallelized_model():
    """Forked from a fresh interpreter, as a script or a notebook's first cell forks them: a test worker's process
    runs threads of its own (its I/O with the test runner), and a fork copies whatever lock one of them holds."""
    code = "from tests.lightning.test_launcher import fit_and_compare; fit_and_compare('fork'); print('fitted')"
    assert "fitted" in run_job([sys.executable, "-c", code], ROOT, timeout=300).stdout  # exit 0, no abort: run_job


def test_a_job_started_after_a_launcher_ran_here_picks_its_own_rendezvous(monkeypatch):
    # The spawn launcher leaves its rendezvous in this process's environment; a recipe started afterwards (the
    # walkthroughs, the fault tests) would join it instead of making its own.
    from tests.helpers.jobs import LAUNCH_VARIABLES, job_environment

    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("KEPT", "yes")
    environment = job_environment(drop=("KEPT_NOT",))
    assert not set(LAUNCH_VARIABLES) & set(environment) and environment["KEPT"] == "yes"
