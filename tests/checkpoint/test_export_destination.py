"""An export never deletes what it did not write: a destination holding the user's files, a regular file, the run
folder or the checkpoint exported is refused before anything is read; a previous export is replaced only when asked."""

import pytest

from lightning_seqpar.checkpoint.__main__ import main
from lightning_seqpar.checkpoint.destination import EXPORT_MARKER, export_refusal, mark_export


def test_new_empty_and_marked_destinations_are_the_only_ones_written(tmp_path):
    assert export_refusal(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert export_refusal(tmp_path / "empty") is None
    (tmp_path / "previous").mkdir()
    mark_export(tmp_path / "previous", "test")
    assert "holds a previous export. Pass --overwrite" in export_refusal(tmp_path / "previous")
    assert export_refusal(tmp_path / "previous", overwrite=True) is None
    (tmp_path / "file").write_text("x")
    assert "is a file: an export writes a directory" in export_refusal(tmp_path / "file", overwrite=True)
    assert (tmp_path / "previous" / EXPORT_MARKER).is_file()


def test_a_previous_export_holding_a_file_the_user_added_is_refused_even_with_overwrite(tmp_path):
    previous = tmp_path / "previous"
    (previous / "sub").mkdir(parents=True)
    (previous / "config.json").write_text("{}")
    (previous / "sub" / "model.safetensors").write_bytes(b"weights")
    mark_export(previous, "test")
    assert export_refusal(previous, overwrite=True) is None  # what the export wrote, nothing else
    (previous / "README_mine.md").write_text("mine")
    (previous / "sub" / "notes.txt").write_text("mine")
    reason = export_refusal(previous, overwrite=True)
    assert reason == (f"The export destination {previous} holds a previous export and files it did not write "
                      f"(README_mine.md, sub/notes.txt): replacing it would delete them. Move them out of {previous}, "
                      f"or export to a new directory.")
    (previous / EXPORT_MARKER).write_text('{"written_by": "lightning_seqpar", "from": "old"}')  # no file list
    assert "files it did not write (README_mine.md, config.json" in export_refusal(previous, overwrite=True)


def test_a_run_folder_is_refused_even_with_overwrite(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    mark_export(run, "test")  # even one that looks like an export
    reason = export_refusal(run, overwrite=True, protected=[run / "checkpoints"])
    assert reason.startswith(f"The export destination {run} holds {run / 'checkpoints'}, which must be kept")


@pytest.mark.parametrize("where", ["the run folder", "a folder of the user's files", "a regular file"])
def test_export_hf_refuses_with_exit_2_and_deletes_nothing(tmp_path, capsys, where):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "last.ckpt"
    checkpoint.mkdir(parents=True)
    (run / "pretrain_gpt.log").write_text("log")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("notes")
    (tmp_path / "file.txt").write_text("text")
    out = {"the run folder": run, "a folder of the user's files": tmp_path / "mine",
           "a regular file": tmp_path / "file.txt"}[where]
    assert main(["export-hf", str(checkpoint), str(out), "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert f"The export destination {out}" in error
    assert (run / "pretrain_gpt.log").read_text() == "log" and checkpoint.is_dir()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "notes" and (tmp_path / "file.txt").read_text() == "text"


def test_consolidate_replaces_a_file_only_when_asked(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"mine")
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 2
    assert "exists. Pass --overwrite to replace it" in capsys.readouterr().err
    assert (tmp_path / "model.safetensors").read_bytes() == b"mine"


def test_what_a_killed_export_or_consolidation_left_is_removed_by_the_next_one(tmp_path, capsys):
    import subprocess
    import sys

    from lightning_seqpar.checkpoint.atomic import temporary_path

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    partial = temporary_path(tmp_path / "exported", f"{gone}-1")
    (partial / "model.safetensors").parent.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 1024)
    main(["export-hf", str(tmp_path / "no-checkpoint"), str(tmp_path / "exported")])  # refused, after cleaning
    assert not partial.exists()
