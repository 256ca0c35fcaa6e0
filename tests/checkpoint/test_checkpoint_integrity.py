"""A checkpoint loads exactly as it was written, or is refused naming the file: every file of a sharded checkpoint
is checked against the manifest written with it (size and CRC-32) before any tensor reaches the model."""

import json
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_seqpar.checkpoint.manifest import MANIFEST_FILE
from lightning_seqpar.checkpoint.trainer_checkpoint import verified
from tests.helpers.distributed import run_distributed
from tests.helpers.jobs import ROOT
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CASE = Case("gpt", 2, True, None)
FULL = Case("gpt", 2, True, None, strategy=(("checkpoint_format", "full"),))


def _save(rank, world_size, directory, case=CASE):
    checkpoints = ModelCheckpoint(dirpath=directory, filename="step{step}", every_n_train_steps=1, save_top_k=-1)
    fit(case, world_size, steps=2, callbacks=[checkpoints], enable_checkpointing=True)


def _load(rank, world_size, checkpoint, case=CASE):
    try:
        fit(case, world_size, steps=3, ckpt_path=checkpoint)
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("integrity")
    run_distributed(_save, 2, str(directory))
    first, second = sorted(p for p in directory.iterdir() if p.name.startswith("step"))
    assert (second / MANIFEST_FILE).is_file()
    return first, second


def _copy(saved, tmp_path, name="ckpt"):
    target = tmp_path / name
    shutil.copytree(saved[1], target)
    return target


def _flip(path, offsets):
    data = bytearray(path.read_bytes())
    for offset in offsets:
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _shards(path):
    return sorted(path.glob("*.distcp"))


CORRUPTIONS = {
    "three flipped bytes in a shard": lambda p, s: _flip(_shards(p)[0], [100, 2000, 4000]),
    "one flipped bit in trainer_state.pt": lambda p, s: _flip(p / "trainer_state.pt", [300]),
    "a flipped byte in the index": lambda p, s: _flip(p / ".metadata", [50]),
    "a truncated shard": lambda p, s: _shards(p)[1].write_bytes(_shards(p)[1].read_bytes()[:-10]),
    "a deleted shard": lambda p, s: _shards(p)[0].unlink(),
    "a shard of another save": lambda p, s: shutil.copy(_shards(s[0])[0], p / _shards(s[0])[0].name),
    "a file added": lambda p, s: (p / "__9_0.distcp").write_bytes(b"x" * 64),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_every_kind_of_damage_is_refused_naming_the_file(saved, tmp_path, corruption):
    checkpoint = _copy(saved, tmp_path)
    verified(checkpoint)  # intact: passes
    CORRUPTIONS[corruption](checkpoint, saved)
    with pytest.raises(ValueError, match=rf"{checkpoint}/[^ ]+: .*Resume from the checkpoint before it"):
        verified(checkpoint)
    from lightning_seqpar.checkpoint.__main__ import verify

    assert verify(checkpoint) == 1  # the command agrees with loading


def _edit_manifest(checkpoint, change):
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    change(manifest)
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


MANIFEST_EDITS = {
    "not JSON": lambda p: (p / MANIFEST_FILE).write_text("{not json"),
    "a file's CRC-32 edited": lambda p: _edit_manifest(p, lambda m: m["files"][".metadata"].update(crc32="00000000")),
    "a file's size edited": lambda p: _edit_manifest(p, lambda m: m["files"][".metadata"].update(size=1)),
    "the save id edited": lambda p: _edit_manifest(p, lambda m: m.update(save_id="0" * 32)),
    "a file's entry removed": lambda p: _edit_manifest(p, lambda m: m["files"].pop(".metadata")),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_damaged_or_edited_manifest_is_refused_naming_the_manifest_and_verify_agrees(saved, tmp_path, edit):
    """An edit that leaves valid JSON blames the manifest, not the intact file whose entry changed, and the verify
    command reports what loading refuses."""
    checkpoint = _copy(saved, tmp_path)
    MANIFEST_EDITS[edit](checkpoint)
    with pytest.raises(ValueError, match=rf"manifest {checkpoint}/manifest.json is damaged"):
        verified(checkpoint)
    result = subprocess.run([sys.executable, "-m", "lightning_seqpar.checkpoint", "verify", str(checkpoint)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1 and "manifest.json is damaged" in result.stderr


def test_a_sweep_of_random_edits_loads_nothing_silently(saved, tmp_path):
    rng = random.Random(0)
    silent, edits = 0, 0
    for kind in ("shard", "trainer_state"):
        for _ in range(100):
            checkpoint = tmp_path / "sweep"
            shutil.rmtree(checkpoint, ignore_errors=True)
            shutil.copytree(saved[1], checkpoint)
            target = rng.choice(_shards(checkpoint)) if kind == "shard" else checkpoint / "trainer_state.pt"
            data = bytearray(target.read_bytes())
            offset = rng.randrange(len(data))
            data[offset] = (data[offset] + rng.randrange(1, 256)) % 256  # always another byte
            target.write_bytes(bytes(data))
            edits += 1
            try:
                verified(checkpoint)
                silent += 1
            except ValueError as error:
                assert target.name in str(error)
    assert edits == 200 and silent == 0


def test_every_rank_refuses_a_damaged_checkpoint_before_loading(saved, tmp_path):
    checkpoint = _copy(saved, tmp_path)
    _flip(_shards(checkpoint)[1], [64])
    errors = run_distributed(_load, 2, str(checkpoint))
    assert all(error is not None and _shards(checkpoint)[1].name in error for error in errors), errors


def test_a_plain_lightning_checkpoint_is_refused_with_how_to_start_from_its_weights(tmp_path):
    import lightning.pytorch as pl

    from tests.helpers.models import build, loader, token_data

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(build("gpt"), loader(token_data(1, 1)))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    errors = run_distributed(_load, 2, str(tmp_path / "plain.ckpt"))
    assert all(e is not None and "the checkpoint was not written by SeqParallelStrategy" in e
               and "load_single_device_state_dict(PATH)" in e and "another model" not in e for e in errors), errors


def test_a_checkpoint_path_at_one_of_its_files_names_the_directory(saved):
    shard = _shards(saved[1])[0]
    errors = run_distributed(_load, 2, str(shard))
    assert all(e == f"{shard} is one file of the sharded checkpoint {saved[1]}: resume from the directory, "
                    f"ckpt_path={saved[1]}." for e in errors), errors


def test_a_checkpoint_path_at_the_folder_of_checkpoints_lists_them_on_every_rank(saved):
    errors = run_distributed(_load, 2, str(saved[0].parent))
    listed = f"it holds {saved[0].name}, {saved[1].name}."
    assert all(e is not None and "is a folder of checkpoints, not a checkpoint" in e and listed in e for e in errors), errors


def test_a_deleted_manifest_is_refused_unless_loading_unchecked_is_asked_for(saved, tmp_path):
    checkpoint = _copy(saved, tmp_path)
    (checkpoint / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match=r"has no manifest.json, but its trainer_state.pt names save \w+: it was "
                                         r"written with a manifest, which is gone.*CheckpointConfig\(allow_unverified=True\)"):
        verified(checkpoint)
    errors = run_distributed(_load, 2, str(checkpoint))
    assert all(e is not None and "which is gone" in e for e in errors), errors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert verified(checkpoint, allow_unverified=True) is None
    assert any("its manifest is gone; loaded unchecked as asked" in str(w.message) for w in caught)
    allowed = Case("gpt", 2, True, None, strategy=(("allow_unverified_checkpoint", True),))
    assert run_distributed(_load, 2, str(checkpoint), allowed) == [None, None]


def test_a_checkpoint_written_before_manifests_loads_with_a_warning(saved, tmp_path):
    from lightning_seqpar.checkpoint.sharded import FORMAT_KEY

    checkpoint = _copy(saved, tmp_path)
    (checkpoint / MANIFEST_FILE).unlink()
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    del state[FORMAT_KEY]["save_id"]  # as written before saves had ids
    torch.save(state, checkpoint / "trainer_state.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert verified(checkpoint) is None
    assert any("has no manifest (written before they existed)" in str(w.message) for w in caught)
    assert run_distributed(_load, 2, str(checkpoint)) == [None, None]


def test_the_verify_command_reports_file_by_file(saved, tmp_path):
    command = [sys.executable, "-m", "lightning_seqpar.checkpoint", "verify"]
    good = subprocess.run(command + [str(saved[1])], cwd=ROOT, capture_output=True, text=True)
    assert good.returncode == 0 and "all files are as written" in good.stdout
    checkpoint = _copy(saved, tmp_path)
    _flip(checkpoint / "trainer_state.pt", [10])
    bad = subprocess.run(command + [str(checkpoint)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "trainer_state.pt: content differs from what was written" in bad.stdout
    assert ".metadata: ok" in bad.stdout and "1 file(s) differ" in bad.stdout


def test_a_single_file_checkpoint_is_checked_against_its_zip_crcs(tmp_path):
    """The full format (and trainer_state.pt, and .pt weights): torch.save's zip records carry a CRC-32 that
    torch does not check; loading checks it, so a flipped byte is refused naming the file."""
    from lightning_seqpar.checkpoint.consolidate import load_state_dict_file

    path = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    assert torch.equal(load_state_dict_file(path)["w"], torch.arange(4096, dtype=torch.float32))
    data = bytearray(path.read_bytes())
    offset = bytes(data).index(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[:64]) + 1000
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"The checkpoint {path} is not what was written: its record .* differs"):
        load_state_dict_file(path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ValueError, match=rf"The checkpoint {path} cannot be read as written"):
        load_state_dict_file(path)
    torch.save({"w": torch.zeros(4)}, path)
    data = bytearray(path.read_bytes())
    data[bytes(data).rindex(b"weights/data.pkl") + 2] = 0xFF  # a record's name in the zip directory, not UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"The checkpoint {path} cannot be read as written \('utf-8' codec"):
        load_state_dict_file(path)



def test_every_rank_refuses_a_damaged_single_file_checkpoint(tmp_path):
    run_distributed(_save, 2, str(tmp_path), FULL)
    checkpoint = sorted(tmp_path.glob("step*.ckpt"))[-1]
    assert checkpoint.is_file()
    assert run_distributed(_load, 2, str(checkpoint), FULL) == [None, None]  # intact: resumes
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(data))
    errors = run_distributed(_load, 2, str(checkpoint), FULL)
    assert all(error is not None and f"The checkpoint {checkpoint}" in error for error in errors), errors
