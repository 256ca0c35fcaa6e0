"""Pipeline layouts inside Lightning: checkpoint resume, forward-only validation, errors on every rank.

One group of 4 processes (pp 2 × tp 2) runs everything.
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_seqpar import SeqParallelStrategy
from tests.distributed import run_distributed
from tests.models import build, loader, token_data
from tests.parity import Case, fit

CASE = Case("gpt", 2, True, "selective", (), (), (), 2)


def _trainer(world_size, **strategy):
    return pl.Trainer(strategy=SeqParallelStrategy(tp=2, pp=2, **strategy), accelerator="cpu", devices=world_size,
                      precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _errors(world_size):
    messages = []
    for module, strategy in ((build("gpt", n_layer=3), {}), (build("gpt"), {"num_microbatches": 4})):
        try:
            _trainer(world_size, **strategy).fit(module, loader(token_data(1, 1)))
        except ValueError as error:
            messages.append(str(error))
    return messages


def _run(rank, world_size, directory):
    straight = fit(CASE, world_size, steps=-1, epoch_steps=3, max_epochs=2).losses
    ckpt = ModelCheckpoint(dirpath=directory, save_last=True)
    first = fit(CASE, world_size, steps=-1, callbacks=[ckpt], epoch_steps=3, max_epochs=1, enable_checkpointing=True).losses
    resumed = fit(CASE, world_size, steps=-1, epoch_steps=3, max_epochs=2, ckpt_path=str(Path(directory) / "last.ckpt")).losses
    trainer = _trainer(world_size)
    validated = trainer.validate(build("gpt"), DataLoader(token_data(2, 1, seed=7), batch_size=2), verbose=False)
    return dict(straight=straight, first=first, resumed=resumed, val=validated[0]["val/loss"], errors=_errors(world_size))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    return run_distributed(_run, 4, str(directory)), directory


def test_resume_with_a_pipeline_layout_continues_the_same_loss_curve(runs):
    per_rank, directory = runs
    for run in per_rank:
        assert len(run["straight"]) == 6 and run["first"] == run["straight"][:3]
        assert run["resumed"] == run["straight"][3:]  # weights and every stage's Adam state restored exactly
    # The checkpoint holds the whole unparallelized model, so it loads into one device as it is.
    checkpoint = torch.load(directory / "last.ckpt", weights_only=False)
    assert len(checkpoint["optimizer_states"][0]["pipeline_stages"]) == 2
    build("gpt").load_state_dict(checkpoint["state_dict"], strict=True)


def test_validation_runs_forward_only_through_the_pipeline_and_every_rank_logs_the_loss(runs):
    per_rank, _ = runs
    module = build("gpt").double()
    x, y = token_data(2, 1, seed=7).tensors
    with torch.no_grad():
        want = torch.stack([module.gpt(x[i : i + 2], y[i : i + 2]) for i in range(0, 4, 2)]).mean()
    for run in per_rank:  # torchmetrics keeps MeanMetric's state in float32 whatever the model's precision
        assert run["val"] == pytest.approx(want.item(), rel=1e-7)
        assert run["val"] == per_rank[0]["val"]


def test_bad_pipeline_input_fails_on_every_rank_with_the_reason(runs):
    per_rank, _ = runs
    for run in per_rank:
        assert len(run["errors"]) == 2
        assert "3 transformer layers do not divide into 2 equal pipeline stages" in run["errors"][0]
        assert "batch of 2 samples cannot be cut into num_microbatches=4" in run["errors"][1]
