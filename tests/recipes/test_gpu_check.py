"""``recipes/gpu_check.py --cpu``: the GPU check's dry parts run on CPU, so the script is ready whenever a GPU is."""

import json
import socket
import sys

import pytest

from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def test_the_gpu_check_runs_its_dry_parts_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    with socket.socket() as held:  # a rendezvous port the caller's own process group holds: not the rows'
        held.bind(("127.0.0.1", 0))
        held.listen()
        result = run_job([sys.executable, str(ROOT / "recipes" / "gpu_check.py"), "--cpu", "--json", str(out),
                          "--calibration", str(tmp_path / "rates.json")],
                         tmp_path, timeout=600, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
    # the memory row's prediction prices activations with the planner's probes, not Table 2's formula alone
    assert "predicted peak per rank" in result.stderr + result.stdout
    assert "(activations measured on small copies)" in result.stderr + result.stdout
    assert "CPU; torch 2.13" in result.stdout  # the caption: what the figures were measured on
    rows = json.loads(out.read_text())
    assert [r["check"] for r in rows] == ["memory"] * 2 + ["kernels"] * 2 + ["host syncs", "offload"] + \
        ["speed", "step time", "speed", "speed"] + ["step time"] * 2 + ["kernels"] * 2
    assert [r for r in rows if r["ok"] is False] == []
    memory = rows[:2]  # one rank of a 4-rank world on the fake backend trained, tp 4 and tp 2 x cp 2 priced
    assert all(r["measured"].startswith("trained 2 steps") for r in memory)
    assert all(r["expected"].endswith("MB") for r in memory), memory
    assert all(r["ok"] is True for r in rows if r["check"] in ("kernels", "host syncs", "offload"))
    assert [r["case"].split(":")[0] for r in rows if r["check"] == "speed"] == ["ours", "ours compiled", "plain"]
    # the planner's step time from this device's own rates beside the measured one (judged on a GPU only)
    step = next(r for r in rows if r["check"] == "step time")
    assert "(cpu, gloo, 1 processes)" in step["case"] and "elementwise" in step["case"] and step["ok"] is None
    assert step["measured"].endswith("s measured") and float(step["expected"].split(" s predicted")[0]) > 0
    # more layouts, each trained and planned (full recomputation among them), and the rates kept for the planner
    more = [r for r in rows if r["check"] == "step time"][1:]
    assert [r["case"].split(":")[0].split(", ")[-1] for r in more] == ["full", "none"]
    assert all(r["ok"] is None and float(r["expected"].split(" s predicted")[0]) > 0 for r in more)
    from lightning_seqpar.plan.measuring.calibration import StepCalibration

    rates = StepCalibration.load(tmp_path / "rates.json")
    assert (rates.device, rates.world, rates.collectives) == ("cpu", 1, ())


def test_a_failed_comparison_fails_the_check():
    from recipes import gpu_check

    speed = [gpu_check.Row("speed", f"{lib}: Llama", "1 tokens/s", f"first loss {loss}", None)
             for lib, loss in (("ours", 5.0), ("ours compiled", 5.001), ("plain", 5.2))]
    ours, compiled = gpu_check._loss_rows(speed)
    assert ours.ok is False and compiled.ok is False  # 4e-2 relative: a wrong loss, not bf16 rounding
    assert gpu_check._loss_rows(speed[:2]) == []  # no plain run: nothing to compare
