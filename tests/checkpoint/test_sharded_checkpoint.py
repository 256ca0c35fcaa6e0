"""Sharded checkpoints: written by every rank, resumed under another layout on the uninterrupted curve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint import consolidate, is_sharded_checkpoint, write_state_dict
from lightning_seqpar.checkpoint.safe_reader import read_metadata
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build
from tests.helpers.resume import EPOCH_STEPS, epoch_loader, epoch_trainer, reference_epochs, train_epochs
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

ROOT = Path(__file__).resolve().parents[2]


def _run(rank, world, tp, pp, zero, epochs, directory, resume, async_save=False):
    """Train the seeded tiny GPT under (tp, pp, dp = world/(tp·pp), zero); save last.ckpt; return logged losses."""
    return train_epochs(rank, world, strategy_of(tp=tp, pp=pp, zero=zero, async_save=async_save),
                        build("gpt"), epochs, directory, resume)


def _reference(epochs: int):
    """The uninterrupted one-process run, Lightning without our strategy: logged losses and final weights."""
    module = build("gpt")
    return reference_epochs(module, epochs), {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    return _reference(2)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Epoch 1 of training under three layouts, each checkpointed: {name: (losses, last.ckpt)}."""
    out = {}
    for name, world, tp, pp, zero in [("tp2", 2, 2, 1, 0), ("pp2xtp2", 4, 2, 2, 0), ("tp2xdp2_zero1", 4, 2, 1, 1)]:
        directory = tmp_path_factory.mktemp(name)
        losses = run_distributed(_run, world, tp, pp, zero, 1, str(directory), None)[0]
        out[name] = (losses, directory / "last.ckpt")
    return out


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("source, world, tp, pp, zero", [
    ("tp2", 4, 4, 1, 0),              # tp2 -> tp4 (vocabulary padding 13 -> 16 at tp4)
    ("tp2", 4, 2, 2, 0),              # tp2 -> pp2 x tp2
    ("pp2xtp2", 2, 2, 1, 0),          # pp2 x tp2 -> tp2
    ("tp2xdp2_zero1", 2, 1, 2, 0),    # tp2 x dp2 (ZeRO-1) -> pp2
    ("tp2", 1, 1, 1, 0),              # tp2 -> one process
    ("tp2", 4, 1, 1, 1),              # tp2 -> dp4 (ZeRO-1)
])
def test_resume_under_another_layout_continues_the_one_process_curve(saved, reference, source, world, tp, pp, zero):
    first, checkpoint = saved[source]
    assert is_sharded_checkpoint(checkpoint)
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, pp, zero, 2, "", str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])


def test_consolidated_checkpoint_loads_into_the_plain_model(saved, tmp_path):
    stored = read_metadata(saved["tp2"][1]).state_dict_metadata
    # The tied embedding / LM head is stored once, as torch.save would, and comes back under both keys.
    assert "state_dict.gpt.transformer.wte.weight" in stored and "state_dict.gpt.lm_head.weight" not in stored
    _, after_one_epoch = _reference(1)
    for name in ("tp2", "pp2xtp2"):
        state = consolidate(saved[name][1])
        model = build("gpt").double()
        model.load_state_dict(state)  # strict: same keys, single-device shapes, no vocabulary padding
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, after_one_epoch[key], rtol=1e-9, atol=1e-12, msg=key)
    from safetensors.torch import load_file

    write_state_dict(consolidate(saved["tp2"][1]), tmp_path / "model.safetensors")
    model = build("gpt").double()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, after_one_epoch[key], rtol=1e-9, atol=1e-12, msg=key)
    out = tmp_path / "model.pt"
    result = subprocess.run([sys.executable, "-m", "lightning_seqpar.checkpoint", "consolidate",
                             str(saved["tp2xdp2_zero1"][1]), str(out)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    model = build("gpt").double()
    model.load_state_dict(torch.load(out, weights_only=True))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, after_one_epoch[key], rtol=1e-9, atol=1e-12, msg=key)
    # .safetensors is streamed one tensor at a time: the same state dict, tied keys included, from pp 2 x tp 2 too
    streamed = tmp_path / "streamed.safetensors"
    result = subprocess.run([sys.executable, "-m", "lightning_seqpar.checkpoint", "consolidate",
                             str(saved["pp2xtp2"][1]), str(streamed)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    whole = consolidate(saved["pp2xtp2"][1])
    read = load_file(streamed)
    assert sorted(read) == sorted(whole)
    for key, value in whole.items():
        assert torch.equal(read[key], value), key


def _validatedepoch_trainer(world, tp, pp, **strategy):
    trainer = epoch_trainer(strategy_of(tp=tp, pp=pp, **strategy), world, 1)
    module = build("gpt")
    trainer.validate(module, epoch_loader(1, 0), verbose=False)  # sets up the parallel model
    return trainer, module


def _start_from_single_device(rank, world, path):
    trainer, _ = _validatedepoch_trainer(world, 2, 2)
    trainer.strategy.load_single_device_state_dict(path)
    return trainer.strategy.full_state_dict()


def test_a_single_device_state_dict_is_the_starting_point_of_any_layout(saved, tmp_path):
    path = tmp_path / "single.pt"
    torch.save(consolidate(saved["tp2"][1]), path)
    want = torch.load(path, weights_only=True)
    for whole in run_distributed(_start_from_single_device, 4, str(path)):  # pp 2 x tp 2
        assert whole.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(whole[key], want[key], rtol=0, atol=0, msg=key)


def _bad(rank, world, good, directory):
    errors = {}
    trainer, module = _validatedepoch_trainer(world, 2, 1)
    with torch.no_grad():
        module.gpt.transformer.h[0].mlp.c_fc.weight.view(-1)[1] = float("nan")  # a shard of rank 0 only
    trainer.save_checkpoint(f"{directory}/nan.ckpt")
    for name, model, checkpoint in (("nan", (), f"{directory}/nan.ckpt"), ("wider", (("n_embd", 32),), good)):
        try:
            trainer = epoch_trainer(SeqParallelStrategy(tp=2), world, 2)
            trainer.fit(build("gpt", **dict(model)), epoch_loader(1, 0), ckpt_path=checkpoint)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_bad_sharded_checkpoints_are_refused_on_every_rank_with_the_reason(saved, tmp_path):
    for errors in run_distributed(_bad, 2, str(saved["tp2"][1]), str(tmp_path)):
        assert "'state_dict.gpt.transformer.h.0.mlp.c_fc.weight' holds 1 non-finite value(s)" in errors["nan"]
        assert "found on rank 0" in errors["nan"]
        assert "does not fit this model" in errors["wider"] and "'gpt.transformer.wte.weight'" in errors["wider"]


class _GatedSave(pl.Callback):
    """Saves after step 1 with the write held back until step 3 has trained."""

    def __init__(self, path, gate):
        self.path, self.gate, self.published_while_training, self.at_save = path, gate, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.at_save = trainer.strategy.full_state_dict()
            trainer.save_checkpoint(self.path)
        if trainer.global_step == 3:
            self.published_while_training = is_sharded_checkpoint(Path(self.path))
            self.gate.set()


def _async(rank, world, path):
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    gate, write = threading.Event(), FileSystemWriter.write_data

    def gated(self, plan, planner):
        assert gate.wait(120)
        return write(self, plan, planner)

    FileSystemWriter.write_data = gated
    probe = _GatedSave(path, gate)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy_of(tp=2, async_save=True),
                         precision="64-true", max_steps=4, logger=False, enable_checkpointing=False, callbacks=[probe],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(build("gpt"), epoch_loader(1, 0))  # teardown waits for the save in flight
    return probe.published_while_training, probe.at_save, trainer.global_step


def test_async_save_writes_while_training_goes_on(tmp_path):
    path = tmp_path / "async.ckpt"
    for published_while_training, at_save, steps in run_distributed(_async, 2, str(path)):
        assert steps == 4 and published_while_training is False  # steps 2 and 3 trained while it was written
        state = consolidate(path)  # published once written: the weights as they were at step 1
        for key, value in at_save.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def test_zero1_optimizer_state_is_written_by_the_ranks_that_own_it(saved):
    # tp 2 x dp 2, zero=1: ranks 0, 1 are data-parallel rank 0, ranks 2, 3 data-parallel rank 1. Each writes its own
    # element ranges in place; none assembles another's (as a gather onto data-parallel rank 0 would).
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(saved["tp2xdp2_zero1"][1])).read_metadata()
    writers: dict[str, set[int]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optimizer_states.0.state.") and index.fqn.endswith((".exp_avg", ".exp_avg_sq")):
            writers.setdefault(index.fqn, set()).add(int(info.relative_path.split("_")[2]))
    assert writers
    for fqn, ranks in writers.items():
        assert {rank // 2 for rank in ranks} == {0, 1}, (fqn, ranks)  # both data-parallel ranks wrote a part


def _optimizer_state(path):
    """Every optimizer-state tensor of the sharded checkpoint ``path``, read whole in this process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_seqpar.checkpoint.safe_reader import read_metadata
    from lightning_seqpar.checkpoint.sharded import read_shards

    stored = read_metadata(path).state_dict_metadata
    targets = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in stored.items()
               if k.startswith("optimizer_states.") and isinstance(m, TensorStorageMetadata)}
    read_shards(targets, path, no_dist=True)
    return targets


def test_zero1_state_saved_in_the_background_is_the_state_saved_in_place(saved, tmp_path):
    run_distributed(_run, 4, 2, 1, 1, 1, str(tmp_path), None, True)  # the "tp2xdp2_zero1" run, saved asynchronously
    background, in_place = _optimizer_state(tmp_path / "last.ckpt"), _optimizer_state(saved["tp2xdp2_zero1"][1])
    assert background.keys() == in_place.keys() and any(k.endswith(".exp_avg") for k in background)
    for key, value in in_place.items():
        torch.testing.assert_close(background[key], value, rtol=0, atol=0, msg=key)
