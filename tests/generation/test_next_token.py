"""The next token as transformers' ``generate`` chooses it: temperature, top-k and top-p give the scores transformers'
logits processors give (the same ``-inf`` entries, ties at the k-th kept), and a seeded draw picks the same tokens
as transformers' sampling step; settings out of range are refused by name."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.generation.next_token import TokenChoice

transformers = pytest.importorskip("transformers")


def _transformers_scores(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                       (0.9, 7, 0.6), (1.0, 1, None), (1.0, None, 1e-6)])
def test_the_processed_scores_and_a_seeded_draw_are_transformers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 10] = logits[0, 11]  # a tie
    choice = TokenChoice(True, temperature, top_k, top_p)
    want = _transformers_scores(logits, temperature, top_k, top_p)
    assert torch.equal(choice.scores(logits), want)
    ours = choice.pick(logits, torch.Generator().manual_seed(5))
    torch.manual_seed(5)  # transformers draws from the default generator
    assert torch.equal(ours, torch.multinomial(want.softmax(-1), num_samples=1).squeeze(1))


def test_greedy_takes_the_most_likely_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    assert torch.equal(TokenChoice().pick(logits, None), logits.argmax(-1))


@pytest.mark.parametrize("settings, match", [(dict(temperature=0.0), "temperature=0.0: must be > 0"),
                                             (dict(top_k=0), "top_k=0: a positive integer"),
                                             (dict(top_p=1.5), r"top_p=1.5: in \(0, 1\]")])
def test_settings_out_of_range_are_refused_by_name(settings, match):
    with pytest.raises(ValueError, match=match):
        TokenChoice(True, **settings)


def test_a_generator_per_row_draws_each_row_as_alone():
    logits = torch.randn(3, 13, generator=torch.Generator().manual_seed(0))
    choice = TokenChoice(do_sample=True, temperature=2.0)
    together = choice.pick(logits, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    alone = [choice.pick(logits[i:i + 1], torch.Generator().manual_seed(s)) for i, s in enumerate((1, 2, 3))]
    assert torch.equal(together, torch.cat(alone))
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        choice.pick(logits, [torch.Generator(), torch.Generator()])
