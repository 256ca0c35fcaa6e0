"""The planner searches the pipeline schedules (1F1B, interleaved where vpp > 1, ZB-H1, ZB-V, DualPipeV): each layout
priced once per schedule, exactly as a search of that schedule alone prices it, and the command line says which one each row uses."""

from __future__ import annotations

import json

import pytest

from lightning_seqpar.pipeline_parallel.schedules import splits_backward
from lightning_seqpar.plan import Hardware, model_inventory, plan
from lightning_seqpar.plan.__main__ import main

S, GPUS, BATCH = 2048, 16, 16


def _key(r):
    lay = r.layout
    return (lay.tp, lay.cp, lay.pp, lay.virtual_stages, r.dp, lay.ep, lay.zero, r.micro_batch, lay.recompute,
            lay.schedule)


@pytest.fixture(scope="module")
def searches():
    inventory = model_inventory("gpt-22b", S, "eager")
    run = lambda schedule: plan(inventory, GPUS, S, BATCH, hardware=Hardware(), calibrate=False,  # noqa: E731
                                context_parallel=(1,), schedule=schedule)
    return run(("1F1B", "ZB-H1", "ZB-V", "DualPipeV")), run("1F1B"), run("ZB-H1"), run("ZB-V"), run("DualPipeV")


def test_each_layout_is_priced_per_schedule_as_a_search_of_that_schedule_alone(searches):
    both, one_f_one_b, zero_bubble, v_shaped, dualpipe_v = searches
    alone = {_key(r): r for r in [*one_f_one_b, *zero_bubble, *v_shaped, *dualpipe_v] if r.feasible}
    together = {_key(r): r for r in both if r.feasible}
    assert together.keys() == alone.keys()
    for key, record in together.items():
        assert record.bytes == alone[key].bytes and record.step_time == alone[key].step_time
    piped = [r for r in together.values() if r.layout.pp > 1]
    assert {r.layout.schedule for r in piped} == {"1F1B", "interleaved_1F1B", "ZB-H1", "ZB-V", "DualPipeV"}
    heavier = []
    for r in piped:  # each one's bubble is its own schedule's (Narayanan et al. 2021; Qi et al. 2024, ZB-H1, ZB-V)
        m, p, v = r.layout.num_microbatches, r.layout.pp, r.layout.virtual_stages
        expected = {"1F1B": (p - 1) / m, "interleaved_1F1B": (p - 1) / (v * m), "ZB-H1": (p - 1) / (3 * m),
                    "ZB-V": (p - 1) / (6 * m), "DualPipeV": (p - 1) / (6 * m)}  # idle over compute; ZB-V's from
        # m = 2p − 2 (a longer ramp below), DualPipeV's from its least m = 2p
        if r.layout.schedule == "ZB-V" and m < 2 * p - 2:
            assert r.bubble > expected["ZB-V"] and r.layout.virtual_stages == 2
            continue
        if splits_backward(r.layout.schedule) and r.layout.recompute == "full":  # B makes the forward again: idles more
            heavier.append((r, together.get(_key(r)[:8] + ("none", r.layout.schedule))))
            continue
        assert r.bubble == pytest.approx(expected[r.layout.schedule])
        assert r.layout.schedule != "ZB-H1" or r.layout.virtual_stages == 1
        assert r.layout.schedule not in ("ZB-V", "DualPipeV") or r.layout.virtual_stages == 2
    pairs = [(r, twin) for r, twin in heavier if twin is not None]
    assert pairs and all(r.bubble > twin.bubble > 0 for r, twin in pairs)
    # DualPipeV's pairs run one after the other: ZB-V's bubble. Its peak differs: one chunk micro-batch more in flight,
    # but its steady state's whole backwards leave no W waiting (ZB-V's last rank holds many at its cool-down)
    # with F = B = W (B heavier, full recomputation's: at p 4, m 8, DualPipeV idles 11.1 % of its time, ZB-V 8.6 %)
    twins = [(r, together.get(_key(r)[:-1] + ("ZB-V",))) for r in piped
             if r.layout.schedule == "DualPipeV" and r.layout.recompute != "full"]
    assert twins and all(r.bubble == twin.bubble for r, twin in twins if twin is not None)
    short = [(r, r.layout.num_microbatches or 0, r.layout.pp) for r in dualpipe_v]
    assert any(r.reason == f"micro-batches={m} < 2·pp={2 * p}: DualPipeV's warm-up sends 2·pp through rank 0's first "
               f"chunk" for r, m, p in short if p <= m < 2 * p)
    assert all(r.layout.schedule == "1F1B" for r in both if r.layout.pp == 1)
    # beside 1F1B, ZB-H1 is not offered chunks it cannot run (asked alone, they are refused by name)
    assert not any(r.layout.schedule == "ZB-H1" and r.layout.virtual_stages > 1 for r in both)
    assert any("ZB-H1 runs one model chunk per rank" in (r.reason or "") for r in zero_bubble)
    assert not any(r.layout.schedule == "ZB-V" and r.layout.virtual_stages != 2 for r in both)
    assert any("ZB-V runs two model chunks per rank in a V (vpp=1)" in (r.reason or "") for r in v_shaped)
    ranked = [r.step_time["total"] for r in both if r.feasible]
    assert ranked == sorted(ranked)


def test_the_command_line_searches_every_schedule_by_default_and_names_each_row_s(capsys):
    args = ["gpt-22b", "--gpus", str(GPUS), "--seq-len", str(S), "--global-batch", str(BATCH), "--analytic",
            "--cp", "1"]
    assert main(args + ["--top", "20"]) == 0
    out = capsys.readouterr().out
    assert "| vpp | schedule | dp |" in out and "| ZB-H1 |" in out and "| interleaved_1F1B |" in out
    assert "| ZB-V |" in out and "bubble (1F1B or ZB-H1 or ZB-V or DualPipeV where pp > 1)" in out
    assert main(args + ["--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    names = {r["layout"]["schedule"] for r in records if r["feasible"] and r["layout"]["pp"] > 1}
    assert names == {"1F1B", "interleaved_1F1B", "ZB-H1", "ZB-V", "DualPipeV"}
    assert main(args + ["--schedule", "1F1B", "--top", "20"]) == 0
    assert "schedule" not in capsys.readouterr().out.split("\n")[1]  # one schedule: no column
