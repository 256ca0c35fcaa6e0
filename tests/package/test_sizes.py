"""Memory sizes read as users write them, one reading for the planner's command line, AutoLayout and the export."""

import json

import pytest

from lightning_seqpar.sizes import parse_bytes

WRITTEN = [("24GB", 24 * 10**9), ("24G", 24 * 10**9), ("24gb", 24 * 10**9), ("80 GB", 80 * 10**9),
           ("24GiB", 24 * 2**30), ("1.5TiB", int(1.5 * 2**40)), ("24e9", 24 * 10**9), (24e9, 24 * 10**9),
           ("500MB", 500 * 10**6), ("512KiB", 512 * 2**10), ("2000000", 2_000_000), (2**20, 2**20)]


@pytest.mark.parametrize("value, expected", WRITTEN)
def test_sizes_as_users_write_them(value, expected):
    assert parse_bytes(value, "memory") == expected


@pytest.mark.parametrize("value, message", [
    ("24", r"memory='24' has no unit and would be 24 bytes: give a unit, e.g. memory=24GB"),
    ("1000", r"memory='1000' has no unit and would be 1000 bytes"),
    ("24 parsecs", r"unknown unit 'parsecs'"), ("lots", r"'lots' is not a size"), ("0GB", r"not a positive size"),
    (True, r"True is not a size")])
def test_what_is_not_a_size_is_refused_naming_the_value_and_the_unit(value, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(value, "memory")


def test_a_python_number_is_bytes_as_the_apis_document():
    from lightning_seqpar.checkpoint.hf_export import parse_size

    assert parse_bytes(24, "memory") == 24 and parse_bytes(52345.6, "memory") == 52346
    assert parse_size(1234) == 1234 and parse_size("5GB") == 5 * 10**9


def test_auto_layout_reads_a_size_and_refuses_a_bare_small_number():
    from lightning_seqpar.lightning.auto_layout import AutoLayout

    assert AutoLayout(seq_len=8, batch_size=1, memory_budget="24GiB").memory_budget == 24 * 2**30
    assert AutoLayout(seq_len=8, batch_size=1, memory_budget=2e7).memory_budget == 2e7
    with pytest.raises(ValueError, match=r"memory_budget='24' has no unit"):
        AutoLayout(seq_len=8, batch_size=1, memory_budget="24")


@pytest.mark.parametrize("written", ["24G", "24e9", "24"])
def test_the_planner_command_line_reads_gpu_memory_as_written(tmp_path, capsys, written):
    from lightning_seqpar.plan.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonexistent"}))
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--gpus", "2", "--seq-len", "8", "--global-batch", "2", "--gpu-memory", written,
              "--calibration", str(tmp_path / "missing.json")])
    error = capsys.readouterr().err.split("error:")[-1]  # argparse's message, after its usage lines
    assert stop.value.code == 2 and "max_shard_size" not in error
    if written == "24":
        assert "--gpu-memory='24' has no unit and would be 24 bytes" in error
    else:  # read, then the next argument checked is the missing calibration file
        assert "missing.json" in error and "gpu-memory" not in error
