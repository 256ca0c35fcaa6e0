"""Every supported layout trains exactly like one process: loss and every parameter gradient, 3 steps.

Each spawned group of processes runs all cases of its world size; the single-process float64
reference runs here. Tolerances are tight enough that a missing reduction (a factor t or 1/t on
any gradient) fails.
"""

import pytest
import torch

from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, close, world_runs

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

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


runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_loss_and_gradients_match_single_process(runs, world_case):
    world_size, case = world_case
    per_rank = runs(world_size)
    assert_matches_single_process(per_rank, case, world_size, RTOL, ATOL, close(RTOL, ATOL))


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicated_parameters_hold_identical_gradients_on_every_tp_rank(runs, world_size):
    per_rank = runs(world_size)
    for case in CASES[world_size]:
        for start in range(0, world_size, case.tp):
            first = per_rank[start][case].replicated
            for rank in range(start + 1, start + case.tp):
                for step, grads in enumerate(per_rank[rank][case].replicated):
                    assert grads.keys() == first[step].keys()
                    for name, g in grads.items():
                        assert torch.equal(g, first[step][name]), f"{case} rank {rank} {name}"
