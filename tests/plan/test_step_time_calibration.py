"""The step-time model reads measured rates (``--calibration FILE``): the file round-trips and a damaged one is
refused by name; each term is priced exactly as documented; a deliberately wrong calibration changes the ranking (the
time model is used, not decorative); without one the planner says its time is a rough estimate."""

from __future__ import annotations

import json
import math

import pytest

from lightning_seqpar.memory.activations import TransformerShape
from lightning_seqpar.memory.flops import hardware_flops_per_iteration
from lightning_seqpar.plan import Hardware, plan
from lightning_seqpar.plan.__main__ import main
from lightning_seqpar.plan.measuring.calibrate import _after_compute, _fit, _link
from lightning_seqpar.plan.measuring.calibration import COLLECTIVES, Link, StepCalibration
from lightning_seqpar.plan.pricing.cost import Traffic, attention_flops, step_times
from lightning_seqpar.plan.measuring.models import model_inventory
from lightning_seqpar.plan.pricing.state import PARAMETER_BYTES

S = 2048


def calibration(slow_tensor: float = 1.0, **changes) -> StepCalibration:
    """A synthetic H100-like node (an asynchronous device): GEMMs 400 → 700 TFLOP/s, attention 100 → 300 TFLOP/s from
    calls of 1 GFLOP to 1 TFLOP, links 10 µs and 200 GB/s, an AdamW step over 10¹⁰ elements/s, element-wise work at
    3 TB/s and 5 µs per operator, 40 µs more per projection whose backward is split;
    ``slow_tensor`` divides the tensor-parallel all-gather's bandwidth."""
    links = tuple((kind, n, Link(1e-5, 2e11 / (slow_tensor if kind == "all_gather" else 1)))
                  for kind in COLLECTIVES for n in ((2,) if kind == "send_recv" else (2, 4, 8)))
    values = dict(device="synthetic", backend="nccl", world=8, gemm=((1024, 4e14), (8192, 7e14)),
                  attention=((10 ** 9, 1e14), (10 ** 12, 3e14)), collectives=links, optimizer=1e10, memory=3e12,
                  dispatch=5e-6, split=4e-5)
    return StepCalibration(**{**values, **changes})


def test_a_calibration_file_round_trips_and_a_damaged_one_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "rates.json"
    calibration().save(path)
    assert StepCalibration.load(path) == calibration()
    good = json.loads(path.read_text())
    damaged = {
        "not json": "{",
        "a kind missing": json.dumps({**good, "collectives": [r for r in good["collectives"] if r[0] != "all_to_all"]}),
        "a negative bandwidth": json.dumps({**good, "collectives": [["all_gather", 2, 1e-5, -1.0]]
                                            + good["collectives"]}),
        "another format": json.dumps({**good, "format": 7}),
        "format 5: no split-backward overhead": json.dumps(
            {**{k: v for k, v in good.items() if k != "split"}, "format": 5}),
        "no split overhead": json.dumps({k: v for k, v in good.items() if k != "split"}),
        "a negative split overhead": json.dumps({**good, "split": -1e-6}),
        "format 4: collectives' latency back to back": json.dumps({**good, "format": 4}),
        "format 3: element-wise rates of an in-place add": json.dumps({**good, "format": 3}),
        "format 2: attention by sequence length": json.dumps({**good, "format": 2}),
        "the format before the element-wise rates": json.dumps(
            {**{k: v for k, v in good.items() if k not in ("memory", "dispatch")}, "format": 1}),
        "no memory rate": json.dumps({k: v for k, v in good.items() if k != "memory"}),
        "a negative dispatch time": json.dumps({**good, "dispatch": -1e-6}),
        "no GEMM rates": json.dumps({**good, "gemm": []}),
        "a field missing": json.dumps({k: v for k, v in good.items() if k != "attention"}),
        "no optimizer rate": json.dumps({k: v for k, v in good.items() if k != "optimizer"}),
        "a zero optimizer rate": json.dumps({**good, "optimizer": 0}),
    }
    for what, text in damaged.items():
        path.write_text(text)
        with pytest.raises(ValueError) as error:
            StepCalibration.load(path)
        assert str(path) in str(error.value) and "lightning_seqpar.plan calibrate --out" in str(error.value), what


def test_rates_are_interpolated_log_linearly_between_classes_and_held_beyond_them():
    c = calibration()
    assert c.gemm_rate(1024, 1024, 1024) == pytest.approx(4e14)
    assert c.gemm_rate(64, 64, 64) == 4e14 and c.gemm_rate(1 << 16, 1 << 16, 1 << 16) == 7e14
    middle = math.sqrt(1024 * 8192)  # halfway in log(n): the geometric mean of the rates
    assert c.gemm_rate(middle, middle, middle) == pytest.approx(math.sqrt(4e14 * 7e14))
    assert c.attention_rate(10 ** 6) == 1e14 and c.attention_rate(10 ** 15) == 3e14  # by the FLOPs of one call
    assert c.attention_rate(math.sqrt(1e9 * 1e12)) == pytest.approx(math.sqrt(1e14 * 3e14))
    assert c.link("all_reduce", 8) == Link(1e-5, 2e11)
    assert c.link("send_recv", 8) == Link(1e-5, 2e11)  # the nearest size measured (2)


def test_a_link_fit_recovers_latency_and_bandwidth():
    points = [(x, 3e-5 + x / 5e9) for x in (4096, 65536, 1 << 20)]
    link = _fit(points)
    assert link.latency == pytest.approx(3e-5) and link.bandwidth == pytest.approx(5e9)
    assert _fit([(x, x / 1e9 - 1e-6) for x in (1e3, 1e6)]).latency == 0.0  # a negative intercept: through the origin


def test_a_link_s_latency_is_what_a_message_takes_after_compute():
    """Back to back a collective costs 30 µs; after compute, where a step calls it, a call waits 1.47 ms more (the
    ranks' jitter, a transport waking): the link keeps the bandwidth fitted back to back and takes that wait into its
    latency. With no wait the fitted latency stays."""
    back_to_back = [(x, 3e-5 + x / 5e9) for x in (4096, 1 << 18, 1 << 22)]
    link = _link(back_to_back, 1.47e-3)
    assert link.bandwidth == pytest.approx(5e9) and link.latency == pytest.approx(1.5e-3)
    assert _link(back_to_back, 0.0).latency == pytest.approx(3e-5)


def test_the_time_after_compute_is_the_call_s_share_of_burst_and_call():
    """``_after_compute`` times the burst alone and the burst followed by each call, as many calls each, and returns
    each call's difference: here a clock that a burst moves by 2 ms and a call by 1 ms (or 3 ms) after a burst,
    0.1 ms otherwise."""
    clock, last = [0.0], [""]

    def burst():
        clock[0] += 2e-3
        last[0] = "burst"

    def collective(after_burst):
        def call():
            clock[0] += after_burst if last[0] == "burst" else 1e-4
            last[0] = "call"
        return call

    def measure(fn, calls):
        start = clock[0]
        for _ in range(calls):
            fn()
        return (clock[0] - start) / calls

    assert measure(collective(1e-3), 4) == pytest.approx(1e-4)  # back to back
    assert _after_compute([collective(1e-3), collective(3e-3)], burst, measure) == pytest.approx([1e-3, 3e-3])


def test_each_term_is_priced_as_documented():
    slow_gather = calibration(slow_tensor=2)  # all-gathers at 100 GB/s, reduce-scatters at 200 GB/s
    hardware = Hardware(calibration=slow_gather)
    traffic = {"tensor": Traffic(1e9, 100, ("all_gather", "reduce_scatter"), 4, False),
               "data": Traffic(2e9, 1, ("all_reduce",), 16, True)}
    times = step_times(hardware, 1e15, 2e14, (4096, 4096, 4096), 1e12, traffic, bubble=0.25, optimizer_elements=3e9,
                       elementwise=(1e4, 6e12))
    assert times["optimizer"] == pytest.approx(3e9 / 1e10)
    assert times["elementwise"] == pytest.approx(6e12 / 3e12)  # 0.05 s of dispatch hidden behind the device's work
    compute = 8e14 / calibration().gemm_rate(4096, 4096, 4096) + 2e14 / 3e14
    assert times["compute"] == pytest.approx(compute)
    assert times["tensor"] == pytest.approx(100 * 1e-5 + 0.5e9 / 1e11 + 0.5e9 / 2e11)  # half the bytes each way
    assert times["data"] == pytest.approx(2e9 / hardware.inter_node_bandwidth)  # across nodes: not measurable here
    assert times["bubble"] == pytest.approx(0.25 * (compute + times["elementwise"]))  # idle for both
    small_calls = step_times(hardware, 1e15, 2e14, (4096, 4096, 4096), 1e9, traffic, bubble=0.0)
    assert small_calls["compute"] == pytest.approx(compute - 2e14 / 3e14 + 2e14 / 1e14)  # launch-bound calls
    rough = step_times(Hardware(), 1e15, 2e14, (4096, 4096, 4096), 1e12, traffic, bubble=0.0, elementwise=(1e4, 6e12))
    assert rough["compute"] == pytest.approx(1e15 / (0.5 * 989e12))
    assert rough["tensor"] == pytest.approx(1e9 / 450e9) and "optimizer" not in rough and "elementwise" not in rough


def test_attention_flops_are_the_core_attention_share_of_eq_8():
    shape = TransformerShape(s=4096, b=1, h=4096, a=32, L=2, v=32000)
    # Eq. 8 as printed: selective adds exactly the 12·B·L·s²·h the attention term names
    extra = (hardware_flops_per_iteration(shape, 2, "selective") - hardware_flops_per_iteration(shape, 2, "none"))
    assert attention_flops(shape, 2, "selective") - attention_flops(shape, 2, "none") == extra
    assert attention_flops(shape, 2, "none") == 2 * 12 * 2 * 4096 ** 2 * 4096
    assert attention_flops(shape, 2, "full") == attention_flops(shape, 2, "none") * 4 / 3  # one more forward


def test_a_wrong_calibration_changes_the_ranking_and_the_rough_estimate_says_so():
    inventory = model_inventory("gpt-22b", S, "eager")
    kwargs = dict(calibrate=False, context_parallel=(1,), micro_batches=(1,))
    rough = plan(inventory, 16, S, 16, **kwargs)
    measured = plan(inventory, 16, S, 16, hardware=Hardware(calibration=calibration()), **kwargs)
    slow = plan(inventory, 16, S, 16, hardware=Hardware(calibration=calibration(slow_tensor=1000)), **kwargs)
    assert rough[0].timing == "rough estimate" and measured[0].timing == slow[0].timing == "measured rates"
    assert measured[0].layout.tp > 1  # fast links: tensor parallelism pays
    best, slow_best = measured[0], slow[0]
    assert slow_best.layout.tp < best.layout.tp, (slow_best.layout, best.layout)  # a 1000× slower g/ḡ moves the best
    same = next(r for r in slow if (r.layout, r.dp, r.micro_batch) == (best.layout, best.dp, best.micro_batch))
    assert same.step_time["tensor"] > 100 * measured[0].step_time["tensor"]
    assert same.step_time["compute"] == measured[0].step_time["compute"]


def test_the_command_line_reads_a_calibration_or_says_its_time_is_rough(tmp_path, capsys):
    path = tmp_path / "rates.json"
    calibration().save(path)
    args = ["gpt-22b", "--gpus", "16", "--seq-len", str(S), "--global-batch", "16", "--analytic", "--cp", "1",
            "--top", "1"]
    main([*args, "--calibration", str(path)])
    assert f"at the rates measured in {path} (synthetic, nccl, 8 processes)" in capsys.readouterr().out
    main(args)
    assert "a rough estimate (compute at 0.5 of peak" in capsys.readouterr().out
    path.write_text("{}")
    with pytest.raises(SystemExit):
        main([*args, "--calibration", str(path)])
    assert "a damaged or edited calibration file" in capsys.readouterr().err


def test_auto_layout_reads_a_calibration_and_refuses_a_damaged_one_when_constructed(tmp_path):
    from lightning_seqpar.lightning.auto_layout import AutoLayout

    path = tmp_path / "rates.json"
    calibration(slow_tensor=1000).save(path)
    assert AutoLayout(S, 1, calibration=str(path)).rates() == calibration(slow_tensor=1000)
    assert AutoLayout(S, 1).rates() is None
    path.write_text("[")
    with pytest.raises(ValueError, match="not a calibration file"):
        AutoLayout(S, 1, calibration=str(path))


def test_the_gradient_reduction_pays_one_latency_per_bucket():
    """One all-reduce per bucket; under zero 1 a reduce-scatter of the gradients and an all-gather of the parameters
    per bucket, half the volume each at its own rate (here the all-gather at a quarter of the others' bandwidth)."""
    from lightning_seqpar.optim.grad_buckets import DEFAULT_BUCKET_BYTES

    inventory = model_inventory("gpt-22b", S, "eager")
    hardware = Hardware(calibration=calibration(slow_tensor=4), gpus_per_node=16)  # one node: measured rates apply
    records = plan(inventory, 16, S, 16, hardware=hardware, calibrate=False, context_parallel=(1,),
                   micro_batches=(1,))
    for zero in (0, 1):
        record = next(r for r in records if r.feasible and r.dp > 1 and r.layout.zero == zero)
        d, sent = record.dp, record.collective_bytes["data"]
        gradients = sent * d / (2 * (d - 1))  # the float32 gradients each rank reduces
        buckets = math.ceil(gradients / DEFAULT_BUCKET_BYTES)
        assert buckets > 1
        expected = (buckets * 1e-5 + sent / 2e11 if not zero else
                    2 * buckets * 1e-5 + (sent / 2) / 2e11 + (sent / 2) / (2e11 / 4))
        assert record.step_time["data"] == pytest.approx(expected), zero


def test_the_optimizer_step_is_priced_over_the_elements_each_rank_updates():
    inventory = model_inventory("gpt-22b", S, "eager")
    hardware = Hardware(calibration=calibration(), gpus_per_node=16)
    records = plan(inventory, 16, S, 16, hardware=hardware, calibrate=False, context_parallel=(1,),
                   micro_batches=(1,))
    for zero in (0, 1):
        record = next(r for r in records if r.feasible and r.dp > 1 and r.layout.zero == zero and r.layout.pp == 1)
        elements = record.bytes["parameters"] / PARAMETER_BYTES["bf16-mixed"]  # the parameter elements held
        updated = elements / (record.dp if zero else 1)
        assert record.step_time["optimizer"] == pytest.approx(updated / 1e10), zero


def test_one_process_s_rates_plan_one_device_and_a_layout_over_ranks_is_refused_naming_the_command(tmp_path):
    # what recipes/gpu_check.py measures beside its speed row: no collectives, enough for a one-device layout
    from lightning_seqpar.plan.measuring.models import model_inventory

    alone = calibration(world=1, collectives=())
    path = tmp_path / "one.json"
    alone.save(path)
    assert StepCalibration.load(path) == alone
    inventory = model_inventory("gpt-22b", S, "eager")
    kwargs = dict(calibrate=False, context_parallel=(1,), micro_batches=(1,), hardware=Hardware(memory=1e15,
                                                                                              calibration=alone))
    best = plan(inventory, 1, S, 4, **kwargs)[0]
    assert best.timing == "measured rates" and best.step_time["tensor"] == 0 and best.step_time["compute"] > 0
    with pytest.raises(ValueError, match="2 or more processes"):
        plan(inventory, 8, S, 8, **kwargs)


def test_dispatch_shows_where_it_outlasts_an_asynchronous_device_s_work_and_adds_up_on_cpu():
    device_busy, operators, moved = 0.5, 2e5, 3e11  # 1 s of host dispatch at 5 µs, 0.1 s of bytes at 3 TB/s
    queued = calibration()
    assert queued.asynchronous
    assert queued.elementwise_seconds(operators, moved, device_busy) == pytest.approx(0.1 + (1.0 - 0.5 - 0.1))
    assert queued.elementwise_seconds(operators / 10, moved, device_busy) == pytest.approx(0.1)  # hidden
    cpu = calibration(device="cpu", backend="gloo")
    assert not cpu.asynchronous
    assert cpu.elementwise_seconds(operators, moved, device_busy) == pytest.approx(1.0 + 0.1)  # each in its turn


def test_a_core_attention_call_is_priced_at_its_own_size():
    from lightning_seqpar.plan.planner import _attention_call

    inventory = model_inventory("gpt-22b", S, "eager")
    hardware = Hardware(memory=1e15, calibration=calibration())
    records = plan(inventory, 8, S, 8, hardware=hardware, calibrate=False, context_parallel=(1, 2),
                   micro_batches=(1, 2), cp_comm="ring")
    records += plan(inventory, 8, S, 8, hardware=hardware, calibrate=False, context_parallel=(2,),
                    micro_batches=(1,), cp_comm="all_to_all")
    h = inventory.hidden_size
    seen = set()
    for record in records:
        shape = TransformerShape(s=S, b=1, h=h, a=inventory.num_heads, L=inventory.num_layers)
        b, t, c = record.micro_batch, record.layout.tp, record.layout.cp
        expected = (12 * b * S * S * h / (t * c) if record.layout.cp_comm == "all_to_all" and c > 1
                    else 12 * b * (S / c) ** 2 * h / t)  # the ring's blocks: s/c queries against s/c keys
        assert _attention_call(record, shape) == pytest.approx(expected)
        seen.add((c, record.layout.cp_comm, b))
    assert {(1, "ring", 1), (2, "ring", 2), (2, "all_to_all", 1)} <= seen


def test_a_split_backward_s_host_work_is_priced_per_projection_and_micro_batch():
    """A zero-bubble schedule's layout pays the calibrated split overhead for each deferred projection of each of its
    rank's layers, once per micro-batch: summed on CPU, beside the dispatch it joins on an asynchronous device;
    1F1B's layout pays none. With an overhead larger than the bubble it saves, ZB-H1 ranks behind 1F1B."""
    inventory = model_inventory("gpt-22b", S, "eager")
    projections = len(inventory.split_projections)
    assert projections == 4  # qkv, proj, fc, proj
    kwargs = dict(calibrate=False, context_parallel=(1,), micro_batches=(1,), schedule=("1F1B", "ZB-H1"))
    for device, split in (("cpu", 4e-6), ("cpu", 4e-5), ("synthetic", 1.0)):
        hardware = Hardware(calibration=calibration(device=device, split=split), memory=1e15)
        records = [r for r in plan(inventory, 16, S, 16, hardware=hardware, **kwargs)
                   if r.feasible and (r.layout.tp, r.layout.pp, r.dp, r.layout.recompute) == (8, 2, 1, "none")]
        by_schedule = {r.layout.schedule: r for r in records}
        zb, one = by_schedule["ZB-H1"], by_schedule["1F1B"]
        assert "split" not in one.step_time
        calls = zb.layout.num_microbatches * projections * inventory.num_layers // 2
        if device == "cpu":
            assert zb.step_time["split"] == pytest.approx(calls * split)
        else:  # queued kernels: the host's split work shows where it outlasts the device's
            assert 0 < zb.step_time["split"] <= calls * split
        ranked_first = records.index(zb) < records.index(one)  # (feasible records come sorted by their step time)
        assert ranked_first == (split < 1e-5) == (zb.step_time["total"] < one.step_time["total"]), (device, split)
