"""Checkpoint files are written atomically."""

import pytest
import torch

from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO


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


def test_temporaries_of_killed_writers_are_removed_on_the_next_save(tmp_path):
    import os
    import signal
    import stat
    import subprocess
    import sys

    # A writer killed with SIGKILL halfway through its temporary file.
    code = ("import os, time, pathlib; d = pathlib.Path(os.environ['D']); "
            "(d / f'.last.ckpt.tmp-{os.getpid()}').write_bytes(b'half'); print('ready', flush=True); time.sleep(60)")
    killed = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "D": str(tmp_path)}, stdout=subprocess.PIPE)
    assert killed.stdout.readline().strip() == b"ready"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    # A writer still running keeps its file.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".epoch.ckpt.tmp-{alive.pid}").write_bytes(b"in progress")
        synced_directories = []
        real_fsync = os.fsync

        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                synced_directories.append(fd)
            real_fsync(fd)

        os.fsync = fsync
        try:
            AtomicCheckpointIO().save_checkpoint({"step": 3}, tmp_path / "last.ckpt")
        finally:
            os.fsync = real_fsync
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".epoch.ckpt.tmp-{alive.pid}", "last.ckpt"]
        assert len(synced_directories) == 2  # the folder after the cleanup, and after the rename
        assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"step": 3}
    finally:
        alive.kill()
        alive.wait()


def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"Writing the checkpoint {path} failed: No space left on device"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}
