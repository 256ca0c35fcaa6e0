"""A user's own GPT of ``nn.TransformerEncoder`` layers, called as torch documents a causal encoder
(``mask=`` the causal mask, ``is_causal=True``), trains under context parallelism like one process: its layers run on
each cp rank's load-balanced chunks of the sequence (ring or all-to-all attention, padding as the layout's), the whole
sequence gathered back where the stack ends for the user's head and loss (float64, loss and every parameter's
gradient over 3 AdamW steps). A call without the causal hint is refused by name (before: refused at the rewrite as
"declared non-causal")."""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, fit, relative_error_below, run_cases

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CAUSAL = (("causal_hint", True),)
A2A = (("cp_comm", "all_to_all"),)

CASES = {
    2: [
        Case("encoder", 1, True, None, CAUSAL, cp=2),                                  # ring, padding, batch-first
        Case("encoder", 1, True, "selective", CAUSAL + (("batch_first", False),), strategy=A2A, cp=2),
    ],
    4: [
        Case("encoder", 2, True, None, CAUSAL, cp=2),                                  # tp 2 (+SP) × cp 2
        Case("encoder", 1, True, None, CAUSAL + (("norm_first", False),), cp=2),       # cp 2 × dp 2, post-norm
    ],
}

_results: dict = {}


def _per_rank(world_size):
    if world_size not in _results:
        _results[world_size] = run_cases(CASES, world_size)
    return _results[world_size]


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_a_causal_encoder_under_context_parallelism_trains_like_one_process(world_case):
    world_size, case = world_case
    assert_matches_single_process(_per_rank(world_size), case, world_size, loss_rtol=1e-6, loss_atol=1e-8,
                                  grad_matches=relative_error_below(1e-4))


def _not_causal(rank, world_size):
    try:
        fit(Case("encoder", 1, True, None, cp=2), world_size)
    except ValueError as error:
        return str(error)
    return None


def test_an_encoder_called_without_the_causal_hint_is_refused_naming_the_fix():
    for message in run_distributed(_not_causal, 2):
        assert message is not None and "was called without is_causal=True" in message
