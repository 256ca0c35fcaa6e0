"""The planner searches the pipeline schedules (1F1B, interleaved where vpp > 1, ZB-H1): each layout priced once per
schedule, exactly as a search of that schedule alone prices it, and the command line says which one each row uses."""

from __future__ import annotations

import json

import pytest

from lightning_seqpar.plan import Hardware, model_inventory, plan
from lightning_seqpar.plan.__main__ import main

S, GPUS, BATCH = 2048, 16, 16


def _key(r):
    return (r.tp, r.cp, r.pp, r.vpp, r.dp, r.ep, r.zero, r.micro_batch, r.recompute, r.schedule)


@pytest.fixture(scope="module")
def searches():
    inventory = model_inventory("gpt-22b", S, "eager")
    run = lambda schedule: plan(inventory, GPUS, S, BATCH, hardware=Hardware(), calibrate=False,  # noqa: E731
                                context_parallel=(1,), schedule=schedule)
    return run(("1F1B", "ZB-H1")), run("1F1B"), run("ZB-H1")


def test_each_layout_is_priced_per_schedule_as_a_search_of_that_schedule_alone(searches):
    both, one_f_one_b, zero_bubble = searches
    alone = {_key(r): r for r in [*one_f_one_b, *zero_bubble] if r.feasible}
    together = {_key(r): r for r in both if r.feasible}
    assert together.keys() == alone.keys()
    for key, record in together.items():
        assert record.bytes == alone[key].bytes and record.step_time == alone[key].step_time
    piped = [r for r in together.values() if r.pp > 1]
    assert {r.schedule for r in piped} == {"1F1B", "interleaved_1F1B", "ZB-H1"}
    for r in piped:  # each one's bubble is its own schedule's (Narayanan et al. 2021; Qi et al. 2024, ZB-H1)
        m, p, v = r.num_microbatches, r.pp, r.vpp
        expected = {"1F1B": (p - 1) / m, "interleaved_1F1B": (p - 1) / (v * m), "ZB-H1": (p - 1) / (3 * m)}
        assert r.bubble == pytest.approx(expected[r.schedule]) and (r.schedule != "ZB-H1" or r.vpp == 1)
    assert all(r.schedule == "1F1B" for r in both if r.pp == 1)
    # beside 1F1B, ZB-H1 is not offered chunks it cannot run (asked alone, they are refused by name)
    assert not any(r.schedule == "ZB-H1" and r.vpp > 1 for r in both)
    assert any("ZB-H1 runs one model chunk per rank" in (r.reason or "") for r in zero_bubble)
    ranked = [r.step_time["total"] for r in both if r.feasible]
    assert ranked == sorted(ranked)


def test_the_command_line_searches_both_schedules_by_default_and_names_each_row_s(capsys):
    args = ["gpt-22b", "--gpus", str(GPUS), "--seq-len", str(S), "--global-batch", str(BATCH), "--analytic",
            "--cp", "1"]
    assert main(args + ["--top", "20"]) == 0
    out = capsys.readouterr().out
    assert "| vpp | schedule | dp |" in out and "| ZB-H1 |" in out and "| interleaved_1F1B |" in out
    assert "bubble (1F1B or ZB-H1 where pp > 1)" in out
    assert main(args + ["--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["schedule"] for r in records if r["feasible"] and r["pp"] > 1} == {"1F1B", "interleaved_1F1B", "ZB-H1"}
    assert main(args + ["--schedule", "1F1B", "--top", "20"]) == 0
    assert "schedule" not in capsys.readouterr().out.split("\n")[1]  # one schedule: no column
