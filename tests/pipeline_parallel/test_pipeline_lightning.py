"""Pipeline layouts inside Lightning: checkpoint resume, forward-only validation, errors on every rank,
and the contract with the user's module (what is refused, and how).

One group of 4 processes (pp 2 × tp 2) runs the first three; a step that swallows the stage boundary
gets its own 2 processes (it ends that job).
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models import GPTLightningModule
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, gpt_module, loader, token_data
from tests.helpers.parity import Case, fit
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

FULL = (("checkpoint_format", "full"),)  # the single-file format; sharded checkpoints: test_sharded_checkpoint.py
CASE = Case("gpt", 2, True, "selective", (), (), FULL, 2)


class ManualOptimization(GPTLightningModule):
    """A module that steps its optimizer itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = self.gpt(*batch)
        self.manual_backward(loss)
        self.optimizers().step()


class SwallowsExceptions(GPTLightningModule):
    """A step that catches every exception around the forward pass and carries on."""

    def training_step(self, batch, batch_idx):
        try:
            return self.gpt(*batch)
        except Exception:  # noqa: BLE001 - the mistake under test
            return torch.zeros((), requires_grad=True)


def _trainer(world_size, **strategy):
    return pl.Trainer(strategy=strategy_of(tp=2, pp=2, **strategy), accelerator="cpu", devices=world_size,
                      precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _as(cls, module):
    torch.manual_seed(1234)
    return cls(module.gpt.config, learning_rate=1e-2)


def _errors(world_size):
    messages = []
    cases = ((build("gpt", n_layer=3), {}), (build("gpt"), {"num_microbatches": 4}),
             (_as(ManualOptimization, gpt_module()), {}))
    for module, strategy in cases:
        try:
            _trainer(world_size, **strategy).fit(module, loader(token_data(1, 1)))
        except ValueError as error:
            messages.append(str(error))
    return messages


def _resume_error(case, world_size, ckpt_path):
    try:
        fit(case, world_size, steps=-1, epoch_steps=3, max_epochs=2, ckpt_path=ckpt_path)
    except ValueError as error:
        return str(error)
    return None


def _bad_checkpoints(world_size, directory):
    """First error lines of resuming from checkpoints that must be refused, on this rank."""
    directory = Path(directory)
    pp1 = Case("gpt", 2, True, None, strategy=FULL)  # tp 2 × dp 2, no pipeline
    fit(pp1, world_size, steps=-1, epoch_steps=3, max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory / "pp1", save_last=True)])
    if torch.distributed.get_rank() == 0:  # the pipeline checkpoint with one Adam moment corrupted
        checkpoint = torch.load(directory / "last.ckpt", weights_only=False)
        checkpoint["optimizer_states"][0]["pipeline_stages"][1]["state"][0]["exp_avg"].view(-1)[3] = float("nan")
        torch.save(checkpoint, directory / "corrupt.ckpt")
    torch.distributed.barrier()
    wide = Case("gpt", 2, True, None, model=(("n_embd", 32),), pp=2)
    # 4 layers under 1F1B (rank 0: layers 0, 1), resumed under ZB-V (rank 0: layers 0, 3): same shapes, other layers
    four = Case("gpt", 2, True, None, (("n_layer", 4),), (), FULL, 2)
    fit(four, world_size, steps=-1, epoch_steps=3, max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory / "four", save_last=True)])
    v_shaped = Case("gpt", 2, True, None, (("n_layer", 4),), (), FULL + (("schedule", "ZB-V"),), 2)
    return dict(pp1_to_pp2=_resume_error(CASE, world_size, str(directory / "pp1" / "last.ckpt")),
                corrupt=_resume_error(CASE, world_size, str(directory / "corrupt.ckpt")),
                wider=_resume_error(wide, world_size, str(directory / "last.ckpt")),
                other_placement=_resume_error(v_shaped, world_size, str(directory / "four" / "last.ckpt")))


def _run(rank, world_size, directory):
    straight = fit(CASE, world_size, steps=-1, epoch_steps=3, max_epochs=2).losses
    ckpt = ModelCheckpoint(dirpath=directory, save_last=True)
    first = fit(CASE, world_size, steps=-1, callbacks=[ckpt], epoch_steps=3, max_epochs=1, enable_checkpointing=True).losses
    resumed = fit(CASE, world_size, steps=-1, epoch_steps=3, max_epochs=2, ckpt_path=str(Path(directory) / "last.ckpt")).losses
    trainer = _trainer(world_size)
    validated = trainer.validate(build("gpt"), DataLoader(token_data(2, 1, seed=7), batch_size=2), verbose=False)
    whole = trainer.strategy.full_state_dict()  # collective: the single-device state dict on every rank
    return dict(straight=straight, first=first, resumed=resumed, val=validated[0]["val/loss"], errors=_errors(world_size),
                bad_checkpoints=_bad_checkpoints(world_size, directory), whole=whole)


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


def test_every_rank_gets_the_whole_single_device_state_dict_in_process(runs):
    per_rank, _ = runs
    for run in per_rank:
        model = build("gpt").double()
        model.load_state_dict(run["whole"], strict=True)  # every key, full shapes, no vocabulary padding
        for key, value in run["whole"].items():
            torch.testing.assert_close(value, per_rank[0]["whole"][key], rtol=0, atol=0)


def test_bad_pipeline_input_fails_on_every_rank_with_the_reason(runs):
    per_rank, _ = runs
    for run in per_rank:
        assert len(run["errors"]) == 3
        assert "3 transformer layers do not divide into 2 equal pipeline stages" in run["errors"][0]
        assert "batch of 2 samples cannot be cut into num_microbatches=4" in run["errors"][1]
        assert "ManualOptimization uses manual optimization (automatic_optimization=False)" in run["errors"][2]


def _swallow(rank, world_size):
    trainer = pl.Trainer(strategy=SeqParallelStrategy(pp=2), accelerator="cpu", devices=world_size, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(_as(SwallowsExceptions, gpt_module()), loader(token_data(1, 1)))


def test_a_step_that_swallows_the_stage_boundary_is_refused_and_the_job_ends():
    with pytest.raises(AssertionError) as failed:
        run_distributed(_swallow, 2, timeout=120)
    report = str(failed.value)
    # The first stage names the mistake; the last stage, waiting for its activation, fails instead of hanging.
    assert "rank 0:" in report and "The step caught the pipeline's StageOutput" in report
    assert "rank 1:" in report


def test_checkpoints_that_cannot_resume_are_refused_on_every_rank_with_the_reason(runs):
    per_rank, _ = runs
    for run in per_rank:
        bad = run["bad_checkpoints"]
        assert "saved with pp=1; this run has pp=2" in bad["pp1_to_pp2"]
        assert "does not fit this model" in bad["wider"] and "'gpt.transformer.wte.weight'" in bad["wider"]
        # Stage 1 (ranks 2 and 3) holds the NaN; every rank refuses, so none is left waiting in a collective.
        assert "optimizer state 0 (pipeline stage 1) '" in bad["corrupt"] and "found on rank 2" in bad["corrupt"]
        assert "holds 1 non-finite value(s)" in bad["corrupt"]
        # a full checkpoint's optimizer state follows the layers each rank held: another placement is refused
        assert "'placement': 'loop'" in bad["other_placement"] and "this run places them as {'virtual_stages': 2, " \
            "'placement': 'V'" in bad["other_placement"]


def _validate_gpt(rank, world, pp):
    import warnings

    from torch.utils.data import DataLoader

    from lightning_seqpar.models.gpt import GPTConfig
    from lightning_seqpar.models.module import GPTLightningModule

    torch.manual_seed(0)
    data = torch.randint(0, 32, (8, 9))
    loader = DataLoader([(row[:-1], row[1:]) for row in data], batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=SeqParallelStrategy(tp=1, pp=pp) if world > 1
                         else "auto", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, precision="64-true")
    module = GPTLightningModule(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.validate(module, loader, verbose=False)[0]
    return metrics, [str(w.message) for w in caught if "before the ``update``" in str(w.message)]


def test_validation_under_a_pipeline_gives_the_one_process_metrics_without_metric_warnings():
    """The stages before the last compute no loss: their metric objects add nothing (weight 0), and torchmetrics'
    "compute called before update" warning is not raised on every validation (before: on every stage but the last)."""
    (first, warned), (last, warned_last) = run_distributed(_validate_gpt, 2, 2)
    reference, _ = _validate_gpt(0, 1, 1)
    assert warned == warned_last == []
    for metrics in (first, last):
        assert metrics["val/loss"] == pytest.approx(reference["val/loss"], rel=1e-12)
        assert metrics["val/ppl"] == pytest.approx(reference["val/ppl"], rel=1e-12)
