"""Pipeline layouts train exactly like one process: loss, logged loss and every parameter gradient, 3 steps.

Layouts: pp 2 (1F1B, GPipe, interleaved with 2 chunks per rank), pp 2 × tp 2 with and without SP,
pp 2 × tp 2 × dp 2 on 8 processes; the reference GPT and a user's own module around
nn.TransformerEncoder(Layer)s; selective and full recomputation; clipping and accumulation.
"""

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, SEQ, build, reference_run, token_data
from tests.helpers.parity import STEPS, Case, fit
from tests.distributed.test_parity import CLIP_ACCUMULATE, ENCODER_A, ENCODER_B

GPT4 = (("n_layer", 4),)
INTERLEAVED = (("virtual_stages", 2),)
GPIPE = (("schedule", "gpipe"),)
UNTIED = (("tie_weights", False),)

CASES = {
    2: [
        Case("gpt", 1, True, None, (), (), (), 2),
        Case("gpt", 1, True, None, UNTIED, (), GPIPE, 2),
        Case("gpt", 1, True, "selective", GPT4, (), INTERLEAVED, 2),
        Case("gpt", 1, True, "full", GPT4, (), (("pipeline_split", (3, 1)),), 2),
        Case("encoder", 1, True, None, ENCODER_A, (), (), 2),
        Case("encoder", 1, True, "selective", ENCODER_B, (), (), 2),
        Case("gpt", 1, True, None, UNTIED, CLIP_ACCUMULATE, (), 2),
    ],
    4: [
        Case("gpt", 2, True, "selective", (), (), (), 2),
        Case("gpt", 2, False, "selective", (), (), (), 2),
        Case("gpt", 2, True, "selective", GPT4, CLIP_ACCUMULATE, INTERLEAVED, 2),
        Case("encoder", 2, True, "selective", ENCODER_A, (), (), 2),
        Case("encoder", 2, True, "full", ENCODER_B, (), GPIPE, 2),
        Case("gpt", 1, True, None, UNTIED, CLIP_ACCUMULATE, (("zero", 1),), 2),  # pp 2 x dp 2, ZeRO-1
    ],
    8: [
        Case("gpt", 2, True, "selective", (), (), (), 2),
    ],
}
RTOL, ATOL = 1e-9, 1e-11


def _run_cases(rank, world_size):
    return {case: fit(case, world_size) for case in CASES[world_size]}


@pytest.fixture(scope="module")
def runs2():
    return run_distributed(_run_cases, 2)


@pytest.fixture(scope="module")
def runs4():
    return run_distributed(_run_cases, 4)


@pytest.fixture(scope="module")
def runs8():
    return run_distributed(_run_cases, 8)


def _cases():
    return [(w, c) for w in CASES for c in CASES[w]]


def _id(wc):
    w, c = wc
    name = f"{c.kind}{''.join(v[0] for _, v in c.model if isinstance(v, str))}-pp{c.pp}tp{c.tp}dp{c.dp(w)}"
    extras = [f"{k}{v}" for k, v in c.strategy] + ["sp" if c.sequence_parallel else "nosp", str(c.recompute)]
    return "-".join([name, *extras] + (["clip-accumulate"] if c.trainer else []) + (["untied"] if UNTIED[0] in c.model else []))


@pytest.mark.parametrize("world_case", _cases(), ids=[_id(wc) for wc in _cases()])
def test_pipelined_training_matches_single_process(request, world_case):
    world_size, case = world_case
    per_rank = request.getfixturevalue(f"runs{world_size}")
    dp = case.dp(world_size)
    options = dict(case.trainer)
    accumulate = options.get("accumulate_grad_batches", 1)
    ref = reference_run(build(case.kind, **dict(case.model)), token_data(STEPS * accumulate, dp), STEPS, dp,
                        accumulate=accumulate, clip=options.get("gradient_clip_val"))
    for rank in range(world_size):
        record = per_rank[rank][case]
        # sync_dist=True: every rank, whatever its stage, logs the global batch's loss, identically.
        logged = torch.tensor(record.logged, dtype=torch.float64)
        torch.testing.assert_close(logged, torch.tensor(ref.losses, dtype=logged.dtype), rtol=RTOL, atol=ATOL)
        assert record.logged == per_rank[0][case].logged
        assert len(record.grads) == STEPS
        for step, (got, want) in enumerate(zip(record.grads, ref.grads)):
            assert got.keys() == want.keys(), set(got) ^ set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    # The returned loss is the mean over micro-batches on every rank; data-parallel replicas average.
    tp, pp = case.tp, case.pp
    for stage in range(pp):
        replicas = [per_rank[(stage * dp + d) * tp][case].losses for d in range(dp)]
        losses = torch.tensor(replicas, dtype=torch.float64).mean(0) * accumulate
        torch.testing.assert_close(losses, torch.tensor(ref.losses, dtype=losses.dtype), rtol=RTOL, atol=ATOL)


def test_sequence_parallel_sends_one_tp_th_of_the_bytes_across_stages(runs4):
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
