"""A LoRA run from a pretrained directory checkpoints its adapters and their optimizer state only: the frozen base is
recorded (directory, files) instead of written again, read from the directory on resume, under another layout, on
the uninterrupted run's loss curve; a resume reading its base from another directory is refused before training. A
PEFT adapter directory starts a run under another layout with exactly its values."""

from __future__ import annotations

import shutil

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule
from lightning_seqpar.models.finetune import FineTuneModule
from tests.helpers.chat_tokenizer import make_chat_dir
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

LORA = {"r": 4, "alpha": 8}


class _Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _run(rank, world, tp, pp, steps, root, model_dir, checkpoints, resume):
    pl.seed_everything(0, verbose=False)  # the adapters' draw (LoRA's rule, seeded by the run's seed) alike in every run
    record = _Losses()
    callbacks = [record] + ([ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0)] if checkpoints else [])
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=steps, logger=False,
                         strategy=SeqParallelStrategy(tp=tp, pp=pp), enable_checkpointing=bool(checkpoints),
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    data = FineTuneDataModule(str(root / "chat.jsonl"), str(model_dir), 48, 2, val_fraction=0.1)
    trainer.fit(FineTuneModule(str(model_dir), LORA, learning_rate=1e-2), datamodule=data, ckpt_path=resume)
    return record.losses


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_chat_dir(tmp_path_factory.mktemp("lora_base"), 80)


@pytest.fixture(scope="module")
def saved(root):
    losses = run_distributed(_run, 2, 2, 1, 2, root, root / "model", root / "checkpoints", None)[0]
    return losses, root / "checkpoints" / "last.ckpt"


def test_the_checkpoint_holds_the_adapters_and_records_the_base(root, saved):
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_seqpar.checkpoint.sharded import FORMAT_KEY, MODEL_PREFIX
    from lightning_seqpar.checkpoint.trainer_checkpoint import read_trainer_state

    _, checkpoint = saved
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith(MODEL_PREFIX)]
    assert weights and all(".lora_" in k for k in weights)  # no frozen tensor written again
    assert any(".lora_" in k for k in keys if not k.startswith(MODEL_PREFIX))  # the adapters' optimizer state
    frozen = read_trainer_state(checkpoint)[FORMAT_KEY]["layout"]["frozen_base"]
    assert frozen["directory"] == str((root / "model").resolve()) and "model.safetensors" in frozen["files"]
    assert any(k.endswith("q_proj.base_layer.weight") for k in frozen["keys"])


def test_resuming_under_another_layout_reads_the_base_again_and_continues_the_curve(root, saved):
    first, checkpoint = saved
    whole = run_distributed(_run, 2, 2, 1, 4, root, root / "model", None, None)[0]
    resumed = run_distributed(_run, 2, 1, 2, 4, root, root / "model", None, str(checkpoint))[0]
    assert first == pytest.approx(whole[:2], rel=1e-9)
    assert resumed == pytest.approx(whole[2:], rel=1e-6)


def test_a_resume_reading_its_base_from_elsewhere_is_refused(root, saved, tmp_path):
    _, checkpoint = saved
    shutil.copytree(root / "model", tmp_path / "copy")
    with pytest.raises(AssertionError, match=r"holds the trainable weights only; its frozen weights were read from "):
        run_distributed(_run, 2, 2, 1, 4, root, tmp_path / "copy", None, str(checkpoint))


def test_a_resume_on_a_base_whose_content_changed_under_the_same_size_and_time_is_refused(root, saved):
    """One flipped byte of the base's weights, written back with the file's old modification time."""
    import os

    _, checkpoint = saved
    weights = root / "model" / "model.safetensors"
    original, stat = weights.read_bytes(), weights.stat()
    flipped = bytearray(original)
    flipped[-3] ^= 0x01  # inside the last tensor's data
    try:
        weights.write_bytes(bytes(flipped))
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
        with pytest.raises(AssertionError, match=r"holds the trainable weights only; the files of .* changed \(content\) "
                                                 r"since it was saved: \['model.safetensors'\]"):
            run_distributed(_run, 2, 2, 1, 4, root, root / "model", None, str(checkpoint))
    finally:
        weights.write_bytes(original)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _start_from_adapter(rank, world, tp, pp, root, adapter):
    from lightning_seqpar.checkpoint.full_state import full_state_dict
    from lightning_seqpar.checkpoint.stages import merge_over_stages

    class Initial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            mesh = trainer.strategy.mesh
            state = merge_over_stages(full_state_dict(pl_module, mesh.tensor), mesh.pipeline)
            self.adapters = {k: v for k, v in state.items() if ".lora_" in k}

    initial = Initial()
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=1, logger=False,
                         strategy=SeqParallelStrategy(tp=tp, pp=pp), enable_checkpointing=False, callbacks=[initial],
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    data = FineTuneDataModule(str(root / "chat.jsonl"), str(root / "model"), 48, 2, val_fraction=0.1)
    trainer.fit(FineTuneModule(str(root / "model"), adapter=str(adapter)), datamodule=data)
    return initial.adapters


def test_a_peft_adapter_directory_starts_a_run_under_another_layout(root, saved, tmp_path):
    """An adapter exported at tp 2 starts a pp 2 run with exactly its values (read into the shards)."""
    from safetensors.torch import load_file

    adapter = tmp_path / "adapter"
    run_distributed(_export_after_steps, 2, root, adapter)
    stored = load_file(str(adapter / "adapter_model.safetensors"))
    initial = run_distributed(_start_from_adapter, 2, 1, 2, root, adapter)[0]
    assert len(initial) == len(stored) > 0
    for key, value in stored.items():
        live = "model." + key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(initial[live], value), key


def _export_after_steps(rank, world, root, out):
    from lightning_seqpar.checkpoint.peft_export import export_peft_adapter

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=2, logger=False,
                         strategy=SeqParallelStrategy(tp=2), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    data = FineTuneDataModule(str(root / "chat.jsonl"), str(root / "model"), 48, 2, val_fraction=0.1)
    trainer.fit(FineTuneModule(str(root / "model"), LORA, learning_rate=1e-2), datamodule=data)
    export_peft_adapter(trainer.lightning_module, trainer.strategy.mesh, out)


def test_export_hf_of_a_lora_checkpoint_writes_the_adapter_directory_the_run_would_export(root, saved, tmp_path):
    """`python -m lightning_seqpar.checkpoint export-hf` of a LoRA checkpoint (its adapters only; was: "pass --config",
    and the same refusal with it): the PEFT adapter directory, equal to the one the run exports live after the same
    steps, loaded by PEFT onto the base."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_seqpar.checkpoint.__main__ import main

    _, checkpoint = saved
    assert main(["export-hf", str(checkpoint), str(tmp_path / "exported")]) == 0
    assert main(["export-hf", str(checkpoint), str(tmp_path / "with_config"), "--config", str(root / "model")]) == 0
    live = tmp_path / "live"
    run_distributed(_export_after_steps, 2, root, live)
    exported, expected = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "exported", live))
    assert sorted(exported) == sorted(expected) and all(torch.equal(exported[k], expected[k]) for k in expected)
    config = json.loads((tmp_path / "exported" / "adapter_config.json").read_text())
    reference = json.loads((live / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "target_modules", "peft_type")} == {
        k: reference[k] for k in ("r", "lora_alpha", "target_modules", "peft_type")}
    assert config["base_model_name_or_path"] == str(root / "model")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), tmp_path / "with_config")
    key = next(k for k in expected if ".lora_B." in k)
    module = loaded.get_submodule(key.removesuffix(".lora_B.weight")).lora_B["default"]
    assert torch.equal(module.weight, expected[key].to(module.weight.dtype))  # PEFT casts to the base's float32
