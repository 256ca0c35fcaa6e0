"""Pipeline layouts train exactly like one process: loss, logged loss and every parameter gradient, 3 steps.

Layouts: pp 2 (1F1B, GPipe, interleaved with 2 chunks per rank, ZB-H1, ZB-V, DualPipeV), pp 4 (ZB-H1, ZB-V, DualPipeV),
pp 2 × tp 2 with and without SP (and ZB-V and DualPipeV with SP), pp 4 × tp 2 with SP under ZB-H1, ZB-V and
DualPipeV, pp 2 × dp 2 (zero 0 interleaved, zero 1; ZB-V with zero 1), pp 2 × tp 2 × dp 2 on 8 processes; the
reference GPT and a user's own module around nn.TransformerEncoder(Layer)s; selective and full recomputation;
clipping and accumulation.
"""

import pytest
import torch

from tests.helpers.models import BATCH, SEQ
from tests.helpers.parity import STEPS, Case, all_cases, assert_matches_single_process, case_id, close, world_runs
from tests.lightning.test_parity import CLIP_ACCUMULATE, ENCODER_A, ENCODER_B

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

GPT4 = (("n_layer", 4),)
INTERLEAVED = (("virtual_stages", 2),)
GPIPE = (("schedule", "gpipe"),)
UNTIED = (("tie_weights", False),)
ZB_H1 = (("schedule", "ZB-H1"),)  # B/W split: the weight gradients in W actions
ZB_V = (("schedule", "ZB-V"),)  # two chunks per rank in a V, B/W split
DUALPIPE_V = (("schedule", "DualPipeV"),)  # ZB-V's V, steady state in forward-backward pairs; m >= 2p

CASES = {
    2: [
        Case("gpt", 1, True, None, (), (), (), 2),
        Case("gpt", 1, True, None, UNTIED, (), GPIPE, 2),
        Case("gpt", 1, True, "selective", GPT4, (), INTERLEAVED, 2),  # m = p: every forward first
        Case("gpt", 1, True, None, GPT4, (), INTERLEAVED + (("num_microbatches", 4),), 2, batch=4),  # steady state
        Case("gpt", 1, True, "full", GPT4, (), (("pipeline_split", (3, 1)),), 2),
        Case("encoder", 1, True, None, ENCODER_A, (), (), 2),
        Case("encoder", 1, True, "selective", ENCODER_B, (), (), 2),
        Case("gpt", 1, True, None, UNTIED, CLIP_ACCUMULATE, (), 2),
        Case("gpt", 1, True, None, GPT4, (), ZB_H1 + (("num_microbatches", 4),), 2, batch=4),  # W's delayed
        Case("gpt", 1, True, None, GPT4, (), (("num_microbatches", 4),), 2, batch=4),  # its 1F1B twin
        Case("gpt", 1, True, "selective", (), CLIP_ACCUMULATE, ZB_H1, 2),
        Case("encoder", 1, True, "full", ENCODER_A, (), ZB_H1, 2),
        Case("gpt", 1, True, None, GPT4, (), ZB_V + (("num_microbatches", 4),), 2, batch=4),  # tied on rank 0
        Case("gpt", 1, True, "selective", GPT4, CLIP_ACCUMULATE, ZB_V, 2),  # m = p
        Case("gpt", 1, True, "full", GPT4 + UNTIED, (), ZB_V + (("num_microbatches", 3),), 2, batch=3),
        Case("gpt", 1, True, None, GPT4, (), DUALPIPE_V + (("num_microbatches", 4),), 2, batch=4),  # ZB-V's twin
        Case("gpt", 1, True, "selective", GPT4 + UNTIED, CLIP_ACCUMULATE, DUALPIPE_V, 2, batch=4),  # default m = 2p
    ],
    4: [
        Case("gpt", 2, True, "selective", (), (), (), 2),
        Case("gpt", 2, False, "selective", (), (), (), 2),
        Case("gpt", 2, True, "selective", GPT4, CLIP_ACCUMULATE, INTERLEAVED, 2),
        Case("encoder", 2, True, "selective", ENCODER_A, (), (), 2),
        Case("encoder", 2, True, "full", ENCODER_B, (), GPIPE, 2),
        Case("gpt", 1, True, None, UNTIED, CLIP_ACCUMULATE, (("zero", 1),), 2),  # pp 2 x dp 2, ZeRO-1
        Case("gpt", 1, True, None, GPT4, CLIP_ACCUMULATE, INTERLEAVED, 2),  # pp 2 x dp 2, reduced during the schedule
        Case("gpt", 2, True, "selective", GPT4, (), ZB_H1 + (("num_microbatches", 4),), 2, batch=4),  # + tp 2 SP
        Case("gpt", 1, True, None, UNTIED, CLIP_ACCUMULATE, ZB_H1 + (("zero", 1),), 2),  # + dp 2: buckets take W's
        Case("gpt", 1, True, None, GPT4, (), ZB_H1 + (("num_microbatches", 8),), 4, batch=8),  # pp 4
        Case("gpt", 2, True, "selective", GPT4, (), ZB_V + (("num_microbatches", 4),), 2, batch=4),  # + tp 2 SP
        Case("gpt", 1, True, None, GPT4, CLIP_ACCUMULATE, ZB_V + (("zero", 1),), 2),  # + dp 2, ZeRO-1
        Case("gpt", 1, True, None, (("n_layer", 8),), (), ZB_V + (("num_microbatches", 8),), 4, batch=8),  # pp 4
        Case("gpt", 2, True, "selective", GPT4, (), DUALPIPE_V + (("num_microbatches", 4),), 2, batch=4),  # + tp 2 SP
        Case("gpt", 1, True, "full", (("n_layer", 8),), (), DUALPIPE_V + (("num_microbatches", 10),), 4, batch=10),
    ],
    8: [
        Case("gpt", 2, True, "selective", (), (), (), 2),
        # pp 4 × tp 2 with SP under each split schedule (m 8)
        Case("gpt", 2, True, "selective", GPT4, (), ZB_H1 + (("num_microbatches", 8),), 4, batch=8),
        Case("gpt", 2, True, None, (("n_layer", 8),), (), ZB_V + (("num_microbatches", 8),), 4, batch=8),
        Case("gpt", 2, True, "full", (("n_layer", 8),), (), DUALPIPE_V + (("num_microbatches", 8),), 4, batch=8),
    ],
}
RTOL, ATOL = 1e-9, 1e-11


runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_pipelined_training_matches_single_process(runs, world_case):
    world_size, case = world_case
    per_rank = runs(world_size)
    assert_matches_single_process(per_rank, case, world_size, RTOL, ATOL, close(RTOL, ATOL))


def test_sequence_parallel_sends_one_tp_th_of_the_bytes_across_stages(runs):
    runs4 = runs(4)
    with_sp, without_sp = CASES[4][0], CASES[4][1]
    h, t, m = 16, 2, 2  # gpt_module: n_embd 16; micro-batches = pp
    for rank in range(4):
        sp, no_sp = runs4[rank][with_sp].p2p_bytes, runs4[rank][without_sp].p2p_bytes
        first_stage = rank < 2
        kind = "activation" if first_stage else "gradient"
        # Each step, stage 0 sends each micro-batch's [s/t, b/m, h] (SP) or [s, b/m, h] float64 shard forward,
        # stage 1 sends its gradient back.
        assert no_sp[kind] == STEPS * m * SEQ * (BATCH // m) * h * 8
        assert sp[kind] * t == no_sp[kind]
        assert sp["activation" if not first_stage else "gradient"] == 0


def _bit_identical(per_rank, a_case, b_case) -> None:
    """Every rank's losses, logged losses and every gradient of every step of two cases equal bit for bit."""
    for records in per_rank:
        a, b = records[a_case], records[b_case]
        assert a.losses == b.losses and a.logged == b.logged
        for step_a, step_b in zip(a.grads, b.grads, strict=True):
            assert step_a.keys() == step_b.keys()
            assert [n for n in step_a if not torch.equal(step_a[n], step_b[n])] == []


def test_dualpipe_v_trains_bit_identically_to_zb_v(runs):
    """The same layout, ZB-V against DualPipeV: each weight's gradient accumulates over the micro-batches in the same
    order under both (a chunk's W's run in the order of its B's), so losses and gradients are equal bit for bit."""
    zb_v, dualpipe_v = CASES[2][12], CASES[2][15]
    assert dict(zb_v.strategy)["schedule"] == "ZB-V" and dict(dualpipe_v.strategy)["schedule"] == "DualPipeV"
    _bit_identical(runs(2), zb_v, dualpipe_v)


def test_zb_h1_trains_bit_identically_to_1f1b(runs):
    """The same layout, 1F1B against ZB-H1: the W's accumulate each weight's gradient in the order the B's ran, so
    every rank's loss and every gradient of every step are equal bit for bit (float64)."""
    zb, one_f_one_b = CASES[2][8], CASES[2][9]
    assert dict(zb.strategy)["schedule"] == "ZB-H1" and "schedule" not in dict(one_f_one_b.strategy)
    _bit_identical(runs(2), zb, one_f_one_b)
