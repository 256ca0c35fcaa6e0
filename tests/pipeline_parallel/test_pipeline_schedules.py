"""Schedules, stage layouts and the pipeline's input checks, without processes."""

import copy

import pytest
import torch

from lightning_seqpar import Layout, RewriteConfig, SeqParallelStrategy
from lightning_seqpar.lightning.pipelined_steps import split_microbatches
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.pipeline_parallel import (
    Action,
    PipelineConfig,
    RemoteLayer,
    StageLayout,
    bubble_fraction,
    build_schedule,
    check_microbatches,
    resolve_schedule,
    simulate,
    split_stages,
)
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.parallel.placement import is_stage_local
from tests.helpers.models import build

LAYOUTS = [("1F1B", m, p, 1) for m in (2, 4, 8) for p in (2, 4) if m >= p] + \
          [("gpipe", 8, 2, 1), ("gpipe", 4, 4, 1)] + \
          [("interleaved_1F1B", m, p, v) for m, p, v in ((2, 2, 2), (4, 2, 2), (8, 2, 3), (8, 4, 2), (4, 4, 4))] + \
          [("ZB-H1", m, p, 1) for m, p in ((2, 2), (4, 2), (8, 4), (4, 4), (32, 8))] + \
          [("ZB-V", m, p, 2) for m, p in ((2, 2), (4, 2), (8, 4), (4, 4), (7, 4), (32, 8))] + \
          [("DualPipeV", m, p, 2) for m, p in ((4, 2), (5, 2), (8, 4), (11, 4), (16, 8), (32, 8))]


@pytest.mark.parametrize("schedule, m, p, v", LAYOUTS)
def test_every_rank_runs_each_forward_and_backward_once_backward_after_forward(schedule, m, p, v):
    for rank in range(p):
        actions = build_schedule(schedule, m, p, v, rank)
        kinds = "FBW" if schedule in ("ZB-H1", "ZB-V", "DualPipeV") else "FB"
        expected = {Action(k, c, i) for k in kinds for c in range(v) for i in range(m)}
        assert len(actions) == len(expected) and set(actions) == expected
        for c in range(v):
            for i in range(m):
                assert actions.index(Action("F", c, i)) < actions.index(Action("B", c, i))
                if kinds == "FBW":  # W after its B, in the order of the B's
                    assert actions.index(Action("B", c, i)) < actions.index(Action("W", c, i))
            ws = [a.microbatch for a in actions if a.kind == "W" and a.chunk == c]
            assert ws == sorted(ws)
        assert build_schedule(schedule, m, p, v, rank, forward_only=True) == [a for a in actions if a.kind == "F"]


@pytest.mark.parametrize("schedule, m, p, v", LAYOUTS)
def test_schedules_never_deadlock_and_bound_in_flight_micro_batches(schedule, m, p, v):
    peaks = simulate(schedule, m, p, v)
    if schedule == "gpipe":
        assert peaks == [m] * p
    elif schedule == "1F1B":
        assert peaks == [min(p - r, m) for r in range(p)]  # PipeDream-Flush: stage r holds p - r
    elif schedule == "ZB-H1":  # every stage holds p from F to W: 1F1B's first stage's count (Qi et al. §2.1)
        assert peaks == [p] * p
    elif schedule == "ZB-V":  # 2p chunks of L/(2p) layers from F to W: 1F1B's first stage's L layers' worth (§4)
        assert peaks == [2 * p] * p if m >= 2 * p - 1 else all(n <= 2 * p for n in peaks)
    elif schedule == "DualPipeV":  # one chunk more than ZB-V: DeepSeek's "PP + 1" (PP = 2p stages)
        assert peaks == [2 * p + 1] * p
    elif m == p:  # one group of p micro-batches: every forward first, as Megatron runs it
        assert peaks == [m * v] * p
    else:  # Megatron's warm-up: 2(p - r - 1) + (v - 1)p forwards, then one more before the first backward
        assert peaks == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]


def test_a_broken_order_is_reported_as_a_deadlock(monkeypatch):
    import lightning_seqpar.pipeline_parallel.schedules as schedules

    monkeypatch.setattr(schedules, "one_f_one_b", lambda m, p, rank: [a for a in schedules.gpipe(m, p, rank)][::-1])
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate("1F1B", 4, 2)


def test_the_v_placement_goes_down_the_ranks_and_back():
    """ZB-V's placement (Qi et al. 2024 §4): rank r holds stages r and 2p − 1 − r; the embedding and the loss on
    rank 0, the turn (stage p − 1 to p) on rank p − 1."""
    layout = StageLayout.build(8, 4, 2, placement="V")
    assert [layout.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [layout.rank_of(k) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert all(layout.stage(layout.rank_of(k), c) == k for k in range(8) for c in range(2) if layout.stages_of(
        layout.rank_of(k))[c] == k)
    assert PipelineConfig.build(pp=4, num_microbatches=8, schedule="zbv").layout(8) == layout
    assert PipelineConfig.build(pp=4, schedule="ZB-V", virtual_stages=2).virtual_stages == 2
    with pytest.raises(ValueError, match="two model chunks per rank; got virtual_stages=3"):
        StageLayout.build(12, 2, 3, placement="V")
    with pytest.raises(ValueError, match="placement is one of"):
        StageLayout(2, 1, (1, 1), "ring")  # type: ignore[arg-type]


def test_stage_layout_balanced_interleaved_and_explicit():
    layout = StageLayout.build(8, 2, 2)
    assert layout.sizes == (2, 2, 2, 2) and layout.stages_of(0) == [0, 2] and layout.stages_of(1) == [1, 3]
    assert [layout.stage_of_layer(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.bounds(2) == (4, 6) and layout.rank_of(3) == 1
    assert StageLayout.build(5, 2, split=[4, 1]).bounds(1) == (4, 5)


@pytest.mark.parametrize("layers, pp, v, split, match", [
    (3, 2, 1, None, "3 transformer layers do not divide into 2 equal pipeline stages"),
    (4, 2, 3, None, "6 pipeline stages need at least 6 transformer layers; the model has 4"),
    (4, 2, 1, [4, 0], "must give 2 positive layer counts"),
    (4, 2, 1, [2, 1], "sum to the model's 4 layers"),
])
def test_layers_that_do_not_split_as_asked(layers, pp, v, split, match):
    with pytest.raises(ValueError, match=match):
        StageLayout.build(layers, pp, v, split)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp=2, num_microbatches=1), "num_microbatches=1 is smaller than pp=2"),
    (dict(pp=4, num_microbatches=6, virtual_stages=2), "divisible by pp; got 6 with pp=4"),
    (dict(pp=2, schedule="zero_bubble"), "schedule=.zero_bubble.: one of 1F1B"),
    (dict(pp=2, schedule="gpipe", virtual_stages=2), "GPipe runs one model chunk per rank"),
    (dict(pp=2, schedule="interleaved_1F1B"), "needs virtual_stages >= 2"),
    (dict(pp=2, schedule="ZB-H1", virtual_stages=2), "ZB-H1 runs one model chunk per rank"),
    (dict(pp=2, schedule="ZB-H1", compile=True), "cannot be split from it into W actions"),  # checked together
    (dict(pp=2, schedule="ZB-V", virtual_stages=3), "ZB-V places two model chunks per rank in a V"),
    (dict(pp=2, schedule="ZB-V", compile=True), "cannot be split from it into W actions"),
    (dict(pp=2, virtual_stages=0), "`virtual_stages` must be a positive integer, got 0"),
])
def test_strategy_rejects_pipeline_settings_before_launching(kwargs, match):
    compiled = kwargs.pop("compile", False)
    with pytest.raises(ValueError, match=match):
        SeqParallelStrategy(pp=kwargs.pop("pp"), layout=Layout(**kwargs), rewriting=RewriteConfig(compile=compiled))


def test_schedule_names():
    assert resolve_schedule("1f1b", 2) == "interleaved_1F1B" and resolve_schedule("GPipe", 1) == "gpipe"
    assert resolve_schedule("zb-h1", 1) == resolve_schedule("ZBH1", 1) == "ZB-H1"
    assert resolve_schedule("zb-v", 1) == resolve_schedule("ZBV", 2) == "ZB-V"
    assert resolve_schedule("dualpipev", 1) == resolve_schedule("DualPipe_V", 2) == "DualPipeV"
    check_microbatches(4, 2, "interleaved_1F1B")
    check_microbatches(8, 4, "DualPipeV")
    with pytest.raises(ValueError, match=r"num_microbatches=7 is smaller than 2·pp=8: DualPipeV"):
        check_microbatches(7, 4, "DualPipeV")
    with pytest.raises(ValueError, match="DualPipeV needs at least 2·pp micro-batches"):
        build_schedule("DualPipeV", 3, 2, 2, 0)


def test_micro_batches_cut_every_tensor_of_a_nested_batch():
    batch = {"x": torch.arange(12).view(6, 2), "pair": (torch.arange(6), torch.ones(6, 3))}
    parts = split_microbatches(batch, 3)
    assert len(parts) == 3 and torch.equal(parts[1]["x"], batch["x"][2:4]) and parts[2]["pair"][1].shape == (2, 3)
    with pytest.raises(ValueError, match="batch of 6 samples cannot be cut into num_microbatches=4"):
        split_microbatches(batch, 4)
    with pytest.raises(ValueError, match="found sizes \\[5, 6\\]"):
        split_microbatches((torch.zeros(6), torch.zeros(5)), 2)


def _rewritten(kind, **kwargs):
    module = build(kind, **kwargs)
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), False, None, True))
    return module


def test_split_keeps_this_ranks_layers_with_their_single_device_names():
    module = _rewritten("gpt", n_layer=4)
    runtime, remote = split_stages(module, PipelineConfig.build(pp=2, virtual_stages=2), pipeline_rank=1)
    layers = module.gpt.transformer.h
    assert [isinstance(layer, RemoteLayer) for layer in layers] == [True, False, True, False]
    assert remote[0].startswith("gpt.transformer.h.0.") and all(".h.1." not in k and ".h.3." not in k for k in remote)
    assert {k for k in module.state_dict() if ".h." in k} == {k for k in build("gpt", n_layer=4).state_dict()
                                                               if ".h.1." in k or ".h.3." in k}
    assert all(is_stage_local(p) for p in layers[1].parameters())
    assert not is_stage_local(module.gpt.transformer.wte.weight)
    with pytest.raises(RuntimeError, match="called outside a pipeline step"):
        module.gpt(torch.zeros(1, 8, dtype=torch.long))


def test_a_model_without_a_splittable_stack_says_why():
    module = build("encoder", container="modulelist")
    module.more = torch.nn.ModuleList([copy.deepcopy(module.layers[0])])  # a second container of layers
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), False, None, True))
    with pytest.raises(ValueError, match="transformer layers sit in 2 containers"):
        split_stages(module, PipelineConfig.build(pp=2), 0)
    module = build("encoder", container="modulelist")
    module.extra = copy.deepcopy(module.layers[1])  # a layer that is a plain attribute
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), False, None, True))
    with pytest.raises(ValueError, match="'extra' is a plain attribute"):
        split_stages(module, PipelineConfig.build(pp=2), 0)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="found no rewritten transformer layer"):
        split_stages(plain, PipelineConfig.build(pp=2), 0)


@pytest.mark.parametrize("p", range(2, 9))
def test_bubbles_under_the_cost_model_are_the_papers(p):
    """Unit costs (F = B = W): 1F1B idles (p − 1)/(m + p − 1) of the step, ZB-H1 a third of that bubble,
    (p − 1)/(3m + p − 1) (Qi et al. 2024 §2.1); with the paper's unequal costs ZB-H1 still idles less."""
    for m in range(p, 33):
        assert bubble_fraction("1F1B", m, p) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert bubble_fraction("ZB-H1", m, p) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert bubble_fraction("ZB-H1", m, p, costs=(1.0, 1.2, 0.8)) < bubble_fraction("1F1B", m, p, costs=(1.0, 1.2, 0.8))
        # ZB-V: chunks of half a stage (F = B = W = 1/2 of a stage's); from m = 2p − 2 on, no idle time but the
        # ramp: (p − 1)/(6m + p − 1), the least any schedule reaches (the last rank starts p − 1 chunk-F's late)
        zb_v = bubble_fraction("ZB-V", m, p)
        assert zb_v == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12) if m >= 2 * p - 2 else zb_v < 0.25
        heavy = (1.0, 1.2, 0.8)
        assert bubble_fraction("ZB-V", m, p, costs=heavy) < bubble_fraction("ZB-H1", m, p, costs=heavy)
    for m in range(2 * p, 33):
        # DualPipeV's lists, its pairs run one after the other, idle exactly as ZB-V's under unit costs; with
        # W < F < B its whole backwards in the steady state leave a little more
        assert bubble_fraction("DualPipeV", m, p) == pytest.approx(bubble_fraction("ZB-V", m, p), abs=1e-12)
        assert bubble_fraction("ZB-V", m, p, costs=heavy) <= bubble_fraction("DualPipeV", m, p, costs=heavy) < \
            bubble_fraction("ZB-H1", m, p, costs=heavy)
    if p == 4:
        assert (round(bubble_fraction("1F1B", 8, 4), 3), round(bubble_fraction("ZB-H1", 8, 4), 3),
                round(bubble_fraction("ZB-V", 8, 4), 3)) == (0.273, 0.111, 0.059)  # the goal: <= 6 %
    if p == 8:
        assert (round(bubble_fraction("1F1B", 32, 8), 3), round(bubble_fraction("ZB-H1", 32, 8), 3),
                round(bubble_fraction("ZB-V", 32, 8), 3)) == (0.179, 0.068, 0.035)


def test_an_executor_of_a_split_schedule_needs_the_weight_gradient_store():
    from lightning_seqpar.pipeline_parallel.executor import PipelineExecutor
    from lightning_seqpar.pipeline_parallel.config import PipelineConfig

    config = PipelineConfig.build(pp=2, num_microbatches=2, schedule="zb-h1")
    assert config.schedule == "ZB-H1"
    with pytest.raises(ValueError, match="runs W actions"):
        PipelineExecutor(None, None, config)  # type: ignore[arg-type]
