"""Every supported layout trains exactly like one process: loss and every parameter gradient, 3 steps.

Each spawned group of processes runs all cases of its world size; the single-process float64
reference runs here. Tolerances are tight enough that a missing reduction (a factor t or 1/t on
any gradient) fails.
"""

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, reference_run, token_data
from tests.helpers.parity import STEPS, Case, fit

ENCODER_A = (("container", "encoder"), ("batch_first", True), ("norm_first", True), ("activation", "gelu"))
ENCODER_B = (("container", "modulelist"), ("batch_first", False), ("norm_first", False), ("activation", "relu"))

CASES = {
    2: [Case(kind, 2, sp, rc, model) for kind, model in (("gpt", ()), ("encoder", ENCODER_A), ("encoder", ENCODER_B))
        for sp in (True, False) for rc in (None, "selective", "full")],
    4: [Case(kind, tp, sp, rc, model) for kind, model in (("gpt", ()), ("encoder", ENCODER_A), ("encoder", ENCODER_B))
        for tp in (4, 2) for sp, rc in ((True, None), (False, None), (True, "selective"))],
}
# Lightning features that must see whole-model gradients: global-norm clipping across shards, accumulation.
CLIP_ACCUMULATE = (("gradient_clip_val", 0.05), ("accumulate_grad_batches", 2))
CASES[2].append(Case("gpt", 2, True, None, (), CLIP_ACCUMULATE))
CASES[4].append(Case("encoder", 2, True, "selective", ENCODER_A, CLIP_ACCUMULATE))
# ZeRO-1: the optimizer state sharded over the two data-parallel ranks trains exactly as replicated state.
ZERO1 = (("zero", 1),)
CASES[4].append(Case("gpt", 2, True, None, (), CLIP_ACCUMULATE, ZERO1))
RTOL, ATOL = 1e-9, 1e-11


def _run_cases(rank, world_size):
    out = {}
    for case in CASES[world_size]:
        rec = fit(case, world_size)
        out[case] = (rec.losses, rec.grads, rec.replicated, rec.logged)
    return out


@pytest.fixture(scope="module")
def runs2():
    return run_distributed(_run_cases, 2)


@pytest.fixture(scope="module")
def runs4():
    return run_distributed(_run_cases, 4)


def _cases():
    return [(w, c) for w in CASES for c in CASES[w]]


def _id(wc):
    w, c = wc
    extra = ("-clip-accumulate" if c.trainer else "") + "".join(f"-{k}{v}" for k, v in c.strategy)
    return (f"{c.kind}{''.join(v[0] for _, v in c.model if isinstance(v, str))}-tp{c.tp}dp{w // c.tp}-"
            f"{'sp' if c.sequence_parallel else 'nosp'}-{c.recompute}{extra}")


@pytest.mark.parametrize("world_case", _cases(), ids=[_id(wc) for wc in _cases()])
def test_loss_and_gradients_match_single_process(request, world_case):
    world_size, case = world_case
    per_rank = request.getfixturevalue(f"runs{world_size}")
    dp = case.dp(world_size)
    options = dict(case.trainer)
    accumulate = options.get("accumulate_grad_batches", 1)
    ref = reference_run(build(case.kind, **dict(case.model)), token_data(STEPS * accumulate, dp), STEPS, dp,
                        accumulate=accumulate, clip=options.get("gradient_clip_val"))
    # Data-parallel ranks hold different batches: their mean is the global batch's loss.
    ranks_by_dp = [per_rank[d * case.tp][case] for d in range(dp)]
    # Lightning reports each micro-batch's loss divided by the accumulation count.
    losses = torch.tensor([r[0] for r in ranks_by_dp], dtype=torch.float64).mean(0) * accumulate
    torch.testing.assert_close(losses, torch.tensor(ref.losses, dtype=losses.dtype), rtol=RTOL, atol=ATOL)
    for rank in range(world_size):
        # sync_dist=True: every rank logs the global batch's loss, identically.
        logged = torch.tensor(per_rank[rank][case][3], dtype=torch.float64)
        torch.testing.assert_close(logged, torch.tensor(ref.losses, dtype=logged.dtype), rtol=RTOL, atol=ATOL)
        assert logged.tolist() == per_rank[0][case][3]
        grads = per_rank[rank][case][1]
        assert len(grads) == STEPS
        for step, (got, want) in enumerate(zip(grads, ref.grads)):
            assert got.keys() == want.keys(), set(got) ^ set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicated_parameters_hold_identical_gradients_on_every_tp_rank(request, world_size):
    per_rank = request.getfixturevalue(f"runs{world_size}")
    for case in CASES[world_size]:
        for start in range(0, world_size, case.tp):
            first = per_rank[start][case][2]
            for rank in range(start + 1, start + case.tp):
                for step, grads in enumerate(per_rank[rank][case][2]):
                    assert grads.keys() == first[step].keys()
                    for name, g in grads.items():
                        assert torch.equal(g, first[step][name]), f"{case} rank {rank} {name}"
