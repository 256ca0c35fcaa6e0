"""Inputs taken as meant: a model directory without a tokenizer, one without config.json and a checkpoint path at
a folder of checkpoints or at a model directory are each named for what they are, with the fix."""

import pytest

from lightning_seqpar.checkpoint.locate import not_a_checkpoint
from lightning_seqpar.data import TextDataModule


def test_a_model_directory_without_a_tokenizer_is_refused_unless_bytes_are_asked_for(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 50)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"The model directory {model_dir} holds no tokenizer, so the corpus would be "
                                         rf"read as UTF-8 bytes .*data.tokenizer=DIR, or set data.tokenizer=bytes"):
        TextDataModule(str(corpus)).check_model(32000, str(model_dir))
    TextDataModule(str(corpus), tokenizer="bytes").check_model(32000, str(model_dir))
    TextDataModule(str(corpus)).check_model(32000, None)  # a model of random init: bytes are its ids


def test_a_model_directory_without_config_json_is_named(tmp_path):
    from lightning_seqpar.hf.models import causal_lm_config

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} has no config.json, so it is not a Hugging Face model "
                                                rf"directory \(it holds \['model.safetensors'\]\)"):
        causal_lm_config(pretrained=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"No model directory at .*nowhere"):
        causal_lm_config(pretrained=str(tmp_path / "nowhere"))


def _sharded(path):
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")


def test_a_checkpoint_path_at_a_folder_of_checkpoints_lists_them(tmp_path):
    folder = tmp_path / "checkpoints"
    _sharded(folder / "step000200.ckpt")
    _sharded(folder / "last.ckpt")
    (folder / "notes.txt").write_text("")
    assert not_a_checkpoint(folder) == (
        f"{folder} is a folder of checkpoints, not a checkpoint: it holds last.ckpt, step000200.ckpt. Resume from one "
        f"of them, e.g. ckpt_path={folder / 'last.ckpt'}.")


def test_a_checkpoint_path_at_a_model_directory_says_how_to_start_from_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "is a Hugging Face model directory, not a training checkpoint" in not_a_checkpoint(tmp_path)
    assert f"model=hf_pretrained model.pretrained={tmp_path}" in not_a_checkpoint(tmp_path)
    unfinished = tmp_path / "step1.ckpt"
    unfinished.mkdir()
    assert "a sharded checkpoint whose save did not finish" in not_a_checkpoint(unfinished)


def test_the_checkpoint_commands_name_a_folder_of_checkpoints(tmp_path, capsys):
    from lightning_seqpar.checkpoint.__main__ import main

    _sharded(tmp_path / "last.ckpt")
    assert main(["verify", str(tmp_path)]) == 2
    assert "is a folder of checkpoints, not a checkpoint: it holds last.ckpt" in capsys.readouterr().err
