"""``SeqParallelStrategy(layout=AutoLayout(...))`` on 4 CPU processes: under a memory budget the planner's best
layout that fits is chosen before the process groups exist, and it trains (a mixture of experts with its
expert-parallel size chosen too; the reference GPT with a context-parallel size); a budget too small for any layout is refused before training, naming the smallest
world that would fit."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.lightning.auto_layout import AutoLayout, auto_layout_of, planned_model, rank_layouts
from lightning_seqpar.plan import inventory_of_hf_model
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, build, loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(layers=4, kv_heads=4, labels=True)
BATCH, WORLD = 4, 4  # the loader's batch per data-parallel rank
FITS: dict = {}  # the planner's probes, shared by the expectations


def _ranked(world, budget):
    inventory = inventory_of_hf_model(build("hf", **MODEL).model)
    return rank_layouts(inventory, world, SEQ, AutoLayout(SEQ, BATCH, budget), budget, precision="32-true",
                        gpus_per_node=WORLD, fits=FITS)


def _planning_with(fits, rank, planned):
    """Patch the auto layout's planner on this rank: record that it ran, and give it the probes the test made (the
    same model, the same deterministic small copies: each probe set costs ~20 CPU-seconds; the probes themselves are
    checked in ``tests/plan/``)."""
    import lightning_seqpar.lightning.auto_layout as auto_layout

    plan = auto_layout.rank_layouts
    auto_layout.rank_layouts = lambda *args, **kwargs: planned.append(rank) or plan(*args, **{**kwargs, "fits": fits})


def _fit(rank, world, budgets, fits):
    planned = []
    _planning_with(fits, rank, planned)
    out = []
    for budget in budgets:
        strategy = SeqParallelStrategy(layout=AutoLayout(seq_len=SEQ, batch_size=BATCH, memory_budget=budget))
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        try:
            trainer.fit(build("hf", **MODEL), loader(token_data(2, strategy_dp(strategy, world), batch=BATCH), BATCH))
        except ValueError as error:
            out.append(str(error))
            continue
        chosen = strategy.chosen_layout
        out.append(((strategy.layout, chosen.micro_batch), trainer.callback_metrics["train/loss"].item()))
    return out, bool(planned)


def strategy_dp(strategy, world):
    return world // (strategy.tp * strategy.pp) if strategy.chosen_layout else 1


def test_a_budget_chooses_the_best_layout_that_fits_and_it_trains():
    unbounded = _ranked(WORLD, 1e12)
    budget = unbounded[0].bytes["total"] / 0.8 * 0.999  # the fastest layout does not fit: the budget decides
    fitting = _ranked(WORLD, budget)
    assert fitting and len(fitting) < len(unbounded) and fitting[0] != unbounded[0]
    small = min(r.bytes["total"] for r in _ranked(2 * WORLD, 1e12))
    too_small = small / 0.8 * 1.001  # 8 devices fit, 4 do not
    assert not _ranked(WORLD, too_small)
    results = run_distributed(_fit, WORLD, [budget, too_small], FITS)
    assert [planned for _, planned in results] == [True, False, False, False]  # rank 0 chose, for every rank
    best = fitting[0]
    for ((layout, loss), refusal), _ in results:
        assert layout == (best.layout, best.micro_batch)  # the planner's Layout is the one the strategy trained
        assert math.isfinite(loss)
        assert "no layout of this model fits 0.8 ×" in refusal and "The smallest that would fit: 8 devices" in refusal


MOE = dict(family="qwen3_moe", labels=True)


def _moe_ranked(budget):
    inventory = inventory_of_hf_model(build("hf", **MOE).model)
    return rank_layouts(inventory, WORLD, SEQ, AutoLayout(SEQ, BATCH, budget), budget, precision="32-true",
                        gpus_per_node=WORLD, fits=FITS)  # shared with the dense model's: fits are keyed by model


def _fit_moe(rank, world, budget, fits):
    _planning_with(fits, rank, [])
    strategy = SeqParallelStrategy(layout=AutoLayout(seq_len=SEQ, batch_size=BATCH, memory_budget=budget))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(build("hf", **MOE), loader(token_data(2, strategy_dp(strategy, world), batch=BATCH), BATCH))
    chosen = strategy.chosen_layout
    loss = trainer.callback_metrics["train/loss"].item()
    return (strategy.layout, chosen.micro_batch), strategy.mesh.group("ep").size, loss


def test_a_mixture_of_experts_gets_an_expert_parallel_size_chosen_and_trains():
    # The tightest budget whose best layout still splits the experts: the planner's choice, not a default.
    unbounded = _moe_ranked(1e12)
    budgets = sorted({r.bytes["total"] / 0.8 * 1.0001 for r in unbounded})
    budget = next(b for b in budgets if _moe_ranked(b)[0].layout.ep > 1)
    best = _moe_ranked(budget)[0]
    for layout, ep_group, loss in run_distributed(_fit_moe, WORLD, budget, FITS):
        assert layout == (best.layout, best.micro_batch) and ep_group == best.layout.ep > 1
        assert math.isfinite(loss)


def test_layout_auto_names_what_it_needs():
    with pytest.raises(ValueError, match=r"layout=AutoLayout\(seq_len=S, batch_size=B\)"):
        auto_layout_of("auto", 1, 1)
    with pytest.raises(ValueError, match=r"or tp='auto'.*layout=AutoLayout\(seq_len=S, batch_size=B\)"):
        SeqParallelStrategy(tp="auto")
    with pytest.raises(ValueError, match="chooses tp and pp; got tp=2"):
        auto_layout_of(AutoLayout(8, 4), 2, 1)
    with pytest.raises(ValueError, match="headroom"):
        AutoLayout(8, 4, headroom=1.5)
    assert auto_layout_of(dict(seq_len=8, batch_size=4, micro_batches=[1, 2]), 1, 1).micro_batches == (1, 2)


def _fit_gpt(rank, world, cases, fits):
    """The reference GPT under each case's ``AutoLayout``, then under the layout it chose given by hand: the same
    losses show the choice (cp and its communication, the pipeline schedule) is what trained."""
    _planning_with(fits, rank, [])
    out = []
    for auto, by_hand, dp in cases:
        runs = []
        for strategy in (SeqParallelStrategy(layout=AutoLayout(**auto)), SeqParallelStrategy(layout=by_hand)):
            trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=2,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
            trainer.fit(build("gpt"), loader(token_data(2, dp, batch=BATCH), BATCH))  # the same batches
            pipeline = strategy.layout.pipeline
            runs.append(((strategy.layout, strategy.mesh.cp, strategy.layout.cp_comm, strategy.mesh.pp,
                          pipeline.schedule if strategy.mesh.pp > 1 else None),
                         trainer.callback_metrics["train/loss"].item()))
        out.append(runs)
    return out


def test_the_reference_gpt_gets_context_parallelism_or_a_zero_bubble_schedule_chosen_and_trains_as_given_by_hand():
    inventory = inventory_of_hf_model(planned_model(build("gpt")))
    ranked = lambda auto: rank_layouts(inventory, WORLD, SEQ, auto, auto.memory_budget, precision="32-true",  # noqa: E731
                                       gpus_per_node=WORLD, fits=FITS, schedules=auto.schedules,
                                       loss_chunk=None)  # the reference GPT's own loss: priced whole, as chosen
    context = dict(seq_len=SEQ, batch_size=BATCH, memory_budget=1e12, context_parallel=(2,), cp_comm="all_to_all")
    best_cp = ranked(AutoLayout(**context))[0]
    # The tightest budget without cp whose best layout is pipelined with ZB-H1.
    plain = dict(seq_len=SEQ, batch_size=BATCH, context_parallel=(1,))
    budgets = sorted({r.bytes["total"] / 0.8 * 1.0001 for r in ranked(AutoLayout(**plain, memory_budget=1e12))})
    budget = next(b for b in budgets if ranked(AutoLayout(**plain, memory_budget=b))[0].layout.schedule == "ZB-H1")
    best_zb = ranked(AutoLayout(**plain, memory_budget=budget))[0]
    assert best_cp.layout.cp == 2 and best_zb.layout.pp > 1
    # by hand: the planner's own Layout given back to the strategy, which trains it as the choice did
    cases = [(context, best_cp.layout, best_cp.dp), (dict(plain, memory_budget=budget), best_zb.layout, best_zb.dp)]
    expected = [(best_cp.layout, 2, "all_to_all", best_cp.layout.pp, None),
                (best_zb.layout, 1, "ring", best_zb.layout.pp, "ZB-H1")]
    for rank_runs in run_distributed(_fit_gpt, WORLD, cases, FITS):
        for ((chosen, loss), (by_hand, loss_by_hand)), layout in zip(rank_runs, expected):
            assert chosen == by_hand == layout
            assert math.isfinite(loss) and loss == loss_by_hand
