"""Checkpoints resume the same loss curve and are written atomically; Hugging Face models run through the recipe."""

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO
from tests.helpers.distributed import run_distributed
from tests.helpers.jobs import ROOT, run_job
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane



def _resume(rank, world_size, directory):
    # Epoch-based: Lightning restarts a plain DataLoader at the next epoch boundary, so the data order of the
    # resumed run is the uninterrupted run's (a step-based run restarts the interrupted epoch's iterator).
    case = Case("gpt", 2, True, "selective", strategy=(("checkpoint_format", "full"),))
    straight = fit(case, world_size, steps=-1, epoch_steps=3, max_epochs=2).losses
    ckpt = ModelCheckpoint(dirpath=directory, save_last=True)
    first = fit(case, world_size, steps=-1, callbacks=[ckpt], epoch_steps=3, max_epochs=1,
                enable_checkpointing=True).losses
    resumed = fit(case, world_size, steps=-1, epoch_steps=3, max_epochs=2,
                  ckpt_path=str(Path(directory) / "last.ckpt")).losses
    state = torch.load(Path(directory) / "last.ckpt", weights_only=False)["state_dict"]
    return straight, first, resumed, {k: tuple(v.shape) for k, v in state.items()}


def test_full_format_resume_continues_the_same_loss_curve(tmp_path):
    straight, first, resumed, shapes = run_distributed(_resume, 2, str(tmp_path))[0]
    assert len(straight) == 6
    assert first == straight[:3]
    # Weights, Adam moments and step counts restored exactly: the curve continues bit for bit.
    assert resumed == straight[3:]
    # The single-file checkpoint holds the unparallelized model: full shapes, no vocabulary padding.
    assert shapes["gpt.transformer.wte.weight"] == (13, 16)
    assert shapes["gpt.transformer.h.0.attn.c_attn.weight"] == (48, 16)


def _recipe(tmp_path, *overrides):
    cmd = [sys.executable, str(ROOT / "recipes" / "pretrain_gpt.py"), "trainer.max_steps=3", "trainer.val_check_interval=3",
           "trainer.limit_val_batches=1", "sample.max_new_tokens=4", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_job(cmd, tmp_path, timeout=300).stdout


def test_a_llama_shaped_model_trains_and_a_local_hugging_face_directory_fine_tunes(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_seqpar.checkpoint import consolidate

    out = _recipe(tmp_path / "scratch", "model=llama_tiny", "model.num_hidden_layers=2", "model.hidden_size=64")
    assert "--- sample ---" in out and "val/loss" in out
    # Fine-tuning at learning rate 0 keeps the pretrained weights: the checkpoint proves every rank read its slices.
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    pretrained = AutoModelForCausalLM.from_config(config)
    pretrained.save_pretrained(tmp_path / "pretrained")
    _recipe(tmp_path / "tune", "model=hf_pretrained", f"model.pretrained={tmp_path / 'pretrained'}",
            "optim.learning_rate=0.0", "data.tokenizer=bytes")  # a byte-level model: its directory has no tokenizer
    state = consolidate(tmp_path / "tune" / "run" / "checkpoints" / "last.ckpt")
    for key, value in pretrained.state_dict().items():
        torch.testing.assert_close(state[f"model.{key}"], value, rtol=0, atol=0, msg=key)
