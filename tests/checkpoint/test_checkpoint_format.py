"""Sharded checkpoint pieces that need no process group: publishing, recovery, the safe index reader, views."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_seqpar.checkpoint.atomic import publish, recover_stale, temporary_path
from lightning_seqpar.checkpoint.safe_reader import SafeFileSystemReader, read_metadata
from lightning_seqpar.tensor_parallel.sharding import dcp_view, saved_shape
from lightning_seqpar.parallel.placement import ShardSpec


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_directory_replaces_the_previous_one_in_place(tmp_path):
    final = tmp_path / "last.ckpt"
    for step in (1, 2):
        tmp = temporary_path(final)
        tmp.mkdir()
        (tmp / "step").write_text(str(step))
        publish(tmp, final)
        assert (final / "step").read_text() == str(step)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_recovery_restores_the_previous_checkpoint_of_a_writer_killed_between_its_renames(tmp_path):
    pid = _dead_pid()
    old = tmp_path / f".last.ckpt.old-{pid}"  # moved aside; the new one never got its name
    old.mkdir()
    (old / "step").write_text("1")
    partial = tmp_path / f".last.ckpt.tmp-{pid}"
    partial.mkdir()
    (partial / "half").write_text("x")
    other_old = tmp_path / f".epoch.ckpt.old-{pid}"  # moved aside and replaced: the old copy goes
    other_old.mkdir()
    (tmp_path / "epoch.ckpt").mkdir()
    recover_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch.ckpt", "last.ckpt"]
    assert (tmp_path / "last.ckpt" / "step").read_text() == "1"


def test_directories_of_running_writers_are_kept(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = temporary_path(tmp_path / "last.ckpt", writer.pid)
        theirs.mkdir()
        recover_stale(tmp_path)
        assert theirs.exists()
    finally:
        writer.kill()
        writer.wait()
    recover_stale(tmp_path)
    assert not theirs.exists()


def test_the_index_is_read_with_an_allowlist(tmp_path):
    dcp.save({"w": torch.ones(2, 3)}, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert "w" in read_metadata(tmp_path / "ok").state_dict_metadata
    target = {"w": torch.zeros(2, 3)}
    dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path / "ok"), no_dist=True)
    assert torch.equal(target["w"], torch.ones(2, 3))

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        read_metadata(bad)


def test_views_leave_out_vocabulary_padding_and_store_fused_blocks_as_one_contiguous_shard():
    # Padding other than ceil(full/t) rows per rank is not DTensor's uneven split: refused, not mis-saved.
    with pytest.raises(ValueError, match="ceil"):
        dcp_view(torch.zeros(16, 2), ShardSpec(dim=0, full_size=13, padded_size=16), None)
    fused = ShardSpec(dim=0, full_size=12, padded_size=12, chunks=3)
    view = dcp_view(torch.arange(12 * 2.0).reshape(12, 2), fused, None)
    assert view.shape == (3, 4, 2) and saved_shape(fused, (12, 2)) == (3, 4, 2)
    view.zero_()  # a view: loading writes into the parameter itself
    assert saved_shape(None, (5, 2)) == (5, 2)
    # Unequal blocks keep the single-device shape, their pieces described one by one (saved at tp 2 and resumed at
    # pp 2 in tests/hf/test_hf_families_resume.py: Phi-3 under grouped-query attention)
    uneven = ShardSpec(dim=0, full_size=16, padded_size=16, chunks=3, chunk_sizes=(8, 4, 4))
    assert saved_shape(uneven, (16, 2)) == (16, 2)
    assert [uneven.rank_ranges(r, 2) for r in range(2)] == [[(0, 4), (8, 10), (12, 14)], [(4, 8), (10, 12), (14, 16)]]
    with pytest.raises(ValueError, match="chunk_sizes must be"):
        ShardSpec(dim=0, full_size=16, padded_size=16, chunks=3, chunk_sizes=(8, 4, 3))


def test_removal_takes_the_checkpoint_off_its_name_first(tmp_path):
    from lightning_seqpar.checkpoint.atomic import remove
    from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO

    pid = _dead_pid()
    half_deleted = tmp_path / f".step1.ckpt.del-{pid}"  # a removal killed halfway
    half_deleted.mkdir()
    (tmp_path / "step2.ckpt").mkdir()
    (tmp_path / "step2.ckpt" / "__0_0.distcp").write_bytes(b"x")
    AtomicCheckpointIO().remove_checkpoint(tmp_path / "step2.ckpt")
    recover_stale(tmp_path)
    assert list(tmp_path.iterdir()) == []
    remove(tmp_path / "absent.ckpt")  # nothing to do


def test_a_checkpoint_moved_aside_by_a_writer_whose_pid_was_reused_is_restored(tmp_path):
    """The PID in ``.NAME.old-PID-START`` now belongs to a live process that started at another time (a restart
    reused it): the writer is gone, so its moved-aside checkpoint is put back. The same PID and start: kept."""
    from lightning_seqpar.checkpoint.atomic import writer_identity

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid, start = writer_identity(other.pid).split("-")
        reused = tmp_path / f".last.ckpt.old-{pid}-{int(start) + 1}"  # written by an earlier process of that PID
        reused.mkdir()
        (reused / "step").write_text("1")
        running = tmp_path / f".epoch.ckpt.old-{pid}-{start}"  # the live process itself: left alone
        running.mkdir()
        recover_stale(tmp_path)
        assert (tmp_path / "last.ckpt" / "step").read_text() == "1" and not reused.exists()
        assert running.exists() and not (tmp_path / "epoch.ckpt").exists()
    finally:
        other.kill()
        other.wait()
