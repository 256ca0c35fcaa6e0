"""A user's own GPT of ``nn.TransformerEncoder`` layers under context parallelism: called as torch documents a causal
encoder (``is_causal=True``) it trains like one process (its cases share the worlds of
``test_context_parallel_parity.py``: cp 2 ring and all-to-all, tp 2 × cp 2, cp 2 × dp 2); called without the causal
hint it is refused by name (before: refused at the rewrite as "declared non-causal")."""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _not_causal(rank, world_size):
    try:
        fit(Case("encoder", 1, True, None, cp=2), world_size)
    except ValueError as error:
        return str(error)
    return None


def test_an_encoder_called_without_the_causal_hint_is_refused_naming_the_fix():
    for message in run_distributed(_not_causal, 2):
        assert message is not None and "was called without is_causal=True" in message
