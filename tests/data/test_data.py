"""Corpora are read as documented, and bad ones are refused with the reason."""

import numpy as np
import pytest
import torch

from lightning_seqpar.data import TextDataModule


def test_a_bin_file_of_an_odd_size_is_refused(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes() + b"\x01")
    with pytest.raises(ValueError, match="holds 21 bytes, not a multiple of 2"):
        TextDataModule(str(tmp_path / "t.bin"))


def test_ids_beyond_the_vocabulary_are_refused_and_the_vocabulary_is_kept(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.array([1, 2, 700, 3], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="token id 700 \\(first out-of-range id at position 2\\), not below data.vocab_size=512"):
        TextDataModule(str(tmp_path / "t.bin"), vocab_size=512)
    data = TextDataModule(str(tmp_path / "t.bin"), vocab_size=1024, block_size=1, val_fraction=0.5)
    data.setup()
    assert data.vocab_size == 1024 and data.train_set[0][0].tolist() == [1] and data.train_set[1][1].tolist() == [700]
    assert TextDataModule(str(tmp_path / "t.bin")).vocab_size == 701


def test_token_corpora_decode_as_ids_and_byte_corpora_as_text(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(300, 700, dtype=np.uint16).tobytes())
    tokens = TextDataModule(str(tmp_path / "t.bin"), block_size=4, val_fraction=0.5)
    assert tokens.decode(torch.tensor([464, 3])) == "[464 3]"
    assert tokens.prompt("ignored", max_tokens=3).tolist() == [500, 501, 502]
    (tmp_path / "t.txt").write_text("héllo world " * 10)
    text = TextDataModule(str(tmp_path / "t.txt"), block_size=4)
    assert text.decode(text.prompt("The ")) == "The "


def test_a_too_small_split_is_named(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 200)  # 200 bytes and the document separator "\n\n": 202 tokens
    data = TextDataModule(str(tmp_path / "t.txt"), block_size=32, val_fraction=0.05)
    with pytest.raises(ValueError, match="The validation split has 11 tokens, which cannot fill one block of 32 \\+ 1"):
        data.setup()


def test_byte_decoding_survives_ids_a_larger_model_samples():
    data = TextDataModule(None)
    assert data.decode(torch.tensor([72, 105, 300, 33])) == "Hi\ufffd!"
