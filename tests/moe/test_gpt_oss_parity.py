"""gpt-oss trains like one process under tensor, sequence, expert (and expert tensor), data and context parallelism: its router with a
bias, experts stored ``[E, h, 2f]`` with biases and gate/up interleaved and clamped (a limit small enough to clamp
here), attention sinks (a learned logit per head in every softmax row, split with the heads over tp, merged after the
ring's blocks under cp), attention biases, sliding-window and full layers alternating; float64, the loss and every
gradient (sinks, router weight and bias, expert weights and biases) before each of 3 AdamW steps, the load-balancing
loss of ``output_router_logits`` included where named."""

import dataclasses

import pytest

from lightning_seqpar import DispatchConfig
from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, relative_error_below, world_runs
from tests.moe.test_moe_parity import GRAD_BOUND, LOSS_RTOL, moe

pytestmark = pytest.mark.distributed


def oss(tp, ep, recompute=None, capacity=False, **kw):
    case = moe("gpt_oss", tp, ep, recompute, **kw)
    return dataclasses.replace(case, strategy=case.strategy + (("moe", DispatchConfig(8.0)),)) if capacity else case


CASES = {
    2: [
        oss(1, 1),                         # dp 2: every expert on each rank
        oss(1, 2, aux=0.5),                # experts over the data-parallel ranks, the pooled load-balancing loss
        oss(2, 1, "selective"),            # sinks split with the heads, core attention recomputed
        oss(2, 2, "full"),
        oss(2, 2, lora="attention"),       # LoRA on q/v (biased projections): experts, router and sinks frozen
        oss(1, 1, cp=2),                   # the sinks merged after the ring's blocks
        oss(1, 1, aux=0.5, expert_tp=2),   # each expert's width over the data-parallel ranks: gate/up interleaved
    ],
    4: [
        oss(1, 4),
        oss(2, 4, aux=0.5),
        oss(1, 2, pp=2),                   # pp 2 × ep 2 (1F1B): sinks and expert biases on each stage's layers
        oss(2, 2, capacity=True),          # a capacity that drops nothing: biases on the padded rows left out
        oss(2, 2, cp=2),                   # tp 2 × cp 2 × ep 2
        Case("hf", 1, True, None, (("family", "gpt_oss"), ("labels", True)), (), (("ep", 2), ("cp_comm", "all_to_all")),
             cp=2),                        # all-to-all attention: each cp rank applies its head group's sinks
        oss(2, 2, capacity=True, expert_tp=2),  # ep 2 × expert_tp 2 with a capacity: the down bias counted once
    ],
}

runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_gpt_oss_matches_single_process(runs, world_case):
    world_size, case = world_case
    assert_matches_single_process(runs(world_size), case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))
