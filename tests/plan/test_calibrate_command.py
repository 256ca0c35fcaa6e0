"""``python -m lightning_seqpar.plan calibrate`` on this machine (4 gloo processes): it writes a file the planner
reads, with GEMM, attention, optimizer and element-wise rates and every collective fitted at group sizes 2 and 4."""

import pytest

from lightning_seqpar.plan import Hardware, plan
from lightning_seqpar.plan.__main__ import main
from lightning_seqpar.plan.measuring.calibration import COLLECTIVES, StepCalibration
from lightning_seqpar.plan.measuring.models import model_inventory

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def test_calibrate_writes_measured_rates_the_planner_reads(tmp_path, capsys):
    path = tmp_path / "rates.json"
    assert main(["calibrate", "--out", str(path), "--processes", "4", "--repeats", "2"]) == 0
    rates = StepCalibration.load(path)
    assert (rates.device, rates.backend, rates.world) == ("cpu", "gloo", 4)
    assert [n for n, _ in rates.gemm] == [64, 128, 256] and all(rate > 0 for _, rate in rates.gemm + rates.attention)
    assert rates.optimizer > 0 and rates.memory > 0 and rates.dispatch > 0
    measured = {(kind, n) for kind, n, _ in rates.collectives}
    assert measured == {(kind, n) for kind in COLLECTIVES for n in ((2,) if kind == "send_recv" else (2, 4))}
    assert all(link.bandwidth > 0 and link.latency >= 0 for _, _, link in rates.collectives)
    inventory = model_inventory("gpt-22b", 2048, "eager")
    best = plan(inventory, 8, 2048, 8, hardware=Hardware(calibration=rates), calibrate=False,
                context_parallel=(1,), micro_batches=(1,))[0]
    assert best.timing == "measured rates" and best.step_time["total"] > best.step_time["optimizer"] > 0
    assert main(["gpt-22b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "8", "--analytic", "--cp", "1",
                 "--top", "1", "--calibration", str(path)]) == 0
    assert "(cpu, gloo, 4 processes)" in capsys.readouterr().out


def test_one_process_calibrates_its_device_alone_and_none_is_refused_before_starting_any(tmp_path, capsys):
    path = tmp_path / "alone.json"
    assert main(["calibrate", "--out", str(path), "--processes", "1", "--repeats", "1"]) == 0
    rates = StepCalibration.load(path)
    assert (rates.device, rates.world, rates.collectives) == ("cpu", 1, ()) and not rates.asynchronous
    assert "no collectives" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", "unused.json", "--processes", "0"])

