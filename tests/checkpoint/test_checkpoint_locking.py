"""A checkpoint is read as one save: readers hold a shared lock on its folder, publishing takes an exclusive one, so a
reader racing a job that replaces the checkpoint reads all its files from one save; two writers publishing into one
folder take turns instead of failing between their renames ("Directory not empty")."""

import multiprocessing as mp
import time
from pathlib import Path

from lightning_seqpar.checkpoint.atomic import folder_lock, publish, temporary_path

FILES = ("trainer_state.pt", "__0_0.distcp", "__1_0.distcp")


def _write_saves(folder: str, name: str, first: int, count: int, stop_at: float) -> None:
    for version in range(first, first + count):
        if time.monotonic() > stop_at:
            return
        final = Path(folder) / name
        tmp = temporary_path(final)
        tmp.mkdir()
        for file in FILES:
            (tmp / file).write_text(str(version) * 1000)
        publish(tmp, final)


def test_a_reader_holding_the_folder_lock_reads_one_save_while_a_writer_replaces_it(tmp_path):
    _write_saves(str(tmp_path), "last.ckpt", 0, 1, time.monotonic() + 60)
    writer = mp.get_context("fork").Process(target=_write_saves,
                                            args=(str(tmp_path), "last.ckpt", 1, 100_000, time.monotonic() + 4))
    writer.start()
    seen, mixed = set(), 0
    try:
        while writer.is_alive():
            try:
                with folder_lock(tmp_path, exclusive=False):
                    versions = {(tmp_path / "last.ckpt" / file).read_text()[:5] for file in FILES}
            except FileNotFoundError:
                raise AssertionError("a file of the checkpoint vanished while the folder was locked") from None
            mixed += len(versions) > 1
            seen |= versions
    finally:
        writer.join()
    assert len(seen) > 2, "the writer published nothing while the reader read"  # the race was real
    assert mixed == 0


def test_two_writers_publishing_into_one_folder_take_turns(tmp_path):
    ctx = mp.get_context("fork")
    stop_at = time.monotonic() + 3
    writers = [ctx.Process(target=_write_saves, args=(str(tmp_path), "last.ckpt", 1000 * (i + 1), 100_000, stop_at))
               for i in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left aside


def test_another_live_writer_in_the_folder_is_found_and_a_dead_one_is_not(tmp_path):
    import os
    import subprocess
    import sys

    from lightning_seqpar.checkpoint.atomic import other_live_writers, writer_identity

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    temporary_path(tmp_path / "last.ckpt", writer_identity(os.getppid())).mkdir()  # a live job's save in progress
    temporary_path(tmp_path / "step1.ckpt", f"{int(gone.stdout)}-1").mkdir()  # a killed one's
    assert other_live_writers(tmp_path, writer_identity()) == [writer_identity(os.getppid())]
