"""Checkpoint files are written atomically."""

import pytest
import torch

from lightning_seqpar.checkpoint_io import AtomicCheckpointIO


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
