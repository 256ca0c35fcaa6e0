"""Every layout the planner marks feasible for a toy model on 4 GPUs constructs under the strategy and takes a
training step (one of each tensor/pipeline/virtual-stage/data/ZeRO combination, and three with context parallelism,
with its micro-batches and recomputation), and its most loaded rank's model-state bytes are what that rank holds."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.plan import Hardware, inventory_of_hf_model, plan, state_bytes
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, build, loader, token_data
from tests.plan.test_state_bytes import _Held

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(layers=4, kv_heads=4, labels=True)
GLOBAL_BATCH = 8
inventory = inventory_of_hf_model(build("hf", **MODEL).model)


# Of the context-parallel kinds (tp, cp, pp, vpp, dp, zero), three: the rest repeat what these and the others check
CONTEXT_KINDS = {(2, 2, 1, 1, 1, 1), (1, 2, 2, 2, 1, 0), (1, 4, 1, 1, 1, 0)}


def _layouts():
    records = plan(inventory, 4, SEQ, GLOBAL_BATCH, precision="32-true", hardware=Hardware(memory=1e12),
                   micro_batches=(1, 2))
    kinds: dict[tuple, list] = {}
    for r in records:
        kind = (r.layout.tp, r.layout.cp, r.layout.pp, r.layout.virtual_stages, r.dp, r.layout.zero)
        if r.feasible and (r.layout.cp == 1 or kind in CONTEXT_KINDS):
            kinds.setdefault(kind, []).append(r)
    chosen = []  # one per kind, the recomputation and micro-batch size taking turns
    for i, candidates in enumerate(kinds.values()):
        want = (("selective", "full", "none")[i % 3], (1, 2)[i % 2])
        chosen.append(next((r for r in candidates if (r.layout.recompute, r.micro_batch) == want), candidates[0]))
    return chosen, records


def _steps(rank, world, layouts):
    out = []
    for r in layouts:
        held = _Held()
        strategy = SeqParallelStrategy(layout=r.layout)  # the planner's value as it is: recomputation included
        callbacks = [held]
        # Micro-batches: the pipeline schedule's under pp, gradient accumulation otherwise; either way one step.
        batch, accumulate = (GLOBAL_BATCH // r.dp, 1) if r.layout.pp > 1 else (r.micro_batch, r.layout.num_microbatches)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=1,
                             accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             num_sanity_val_steps=0, callbacks=callbacks)
        data = token_data(GLOBAL_BATCH // (r.dp * batch), r.dp, batch=batch)
        trainer.fit(build("hf", **MODEL), loader(data, batch))
        out.append((trainer.callback_metrics["train/loss"].item(), held.held))
    return out


def test_every_feasible_kind_of_layout_trains_and_holds_the_predicted_state():
    layouts, records = _layouts()
    kinds = {(r.layout.tp, r.layout.cp, r.layout.pp, r.layout.virtual_stages, r.dp, r.layout.zero) for r in layouts}
    # tp 4: vocabulary padded 13 -> 16; cp: the data group of d·c ranks reduces the gradients and shards ZeRO
    assert ({(2, 1, 2, 1, 1, 0), (1, 1, 2, 2, 2, 1), (4, 1, 1, 1, 1, 0)} | CONTEXT_KINDS) - kinds == set()
    assert any(not r.feasible for r in records)  # e.g. pp 4 x vpp 2 needs 8 layers
    results = run_distributed(_steps, 4, layouts)
    for index, r in enumerate(layouts):
        for rank in results:
            loss, held = rank[index]
            assert math.isfinite(loss), r
            if held["coordinates"][0] == r.stage and held["coordinates"][1] == 0:  # the most loaded stage
                lay = r.layout
                state = state_bytes(inventory, lay.tp, lay.pp, r.dp * lay.cp, pipeline_rank=r.stage,
                                    vpp=lay.virtual_stages, zero=lay.zero, precision="32-true",
                                    main_params=lay.fp32_main_params)
                predicted = {k: getattr(state, k) for k in ("parameters", "gradients", "main_params", "optimizer")}
                assert {k: held[k] for k in predicted} == predicted, r
                # at the peak: the state, less the .grad a first backward has not made when the step peaks there
                assert {k: r.bytes[k] for k in predicted} == {**predicted, "gradients": r.bytes["gradients"]}
                assert r.bytes["gradients"] in (state.gradients, 0), r
