"""The entropy of each position's distribution over the vocabulary, from logits split over t ranks (padding columns
ignored), equals one process's from the whole logits; and it comes back per position from the model's own loss
(``token_entropy=True``) at tp 2 as on one device."""

from __future__ import annotations

import copy

import torch

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.tensor_parallel.cross_entropy import vocab_parallel_entropy


def test_the_entropy_from_shards_is_the_whole_logits_entropy():
    logits = torch.randn(3, 5, 13, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    padded = torch.cat([logits, torch.full((3, 5, 1), 50.0, dtype=torch.float64)], -1)  # v' = 14: one padding column
    shard = lambda rank: padded[..., 7 * rank:7 * rank + 7]  # noqa: E731
    got = run_emulated(2, lambda group: vocab_parallel_entropy(shard(group.rank), group, 13))
    for entropy in got:
        torch.testing.assert_close(entropy, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vocab_parallel_entropy(logits, ParallelGroup(), 13), want, rtol=1e-12, atol=1e-12)


def test_the_model_s_loss_gives_each_position_s_log_probability_and_entropy_at_tp_2():
    from lightning_seqpar import RewriteContext, rewrite
    from lightning_seqpar.hf.vocabulary import CausalLMLoss
    from tests.helpers.models import build, token_data

    model = build("hf").double().model
    model.loss_function = CausalLMLoss(model.loss_function)
    x = token_data(1, 1).tensors[0][:2]
    labels = x.masked_fill(torch.arange(x.shape[1]) < 3, -100)
    want = model(input_ids=x, labels=labels, token_logps=True, token_entropy=True).loss
    logits = model(input_ids=x).logits[:, :].double()
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(want[1][:, 2:-1], entropy[:, 2:-1], rtol=1e-12, atol=1e-12)  # where labels count

    def one_rank(group):
        copied = copy.deepcopy(model)
        rewrite(copied, RewriteContext(group, True, None, True))
        return copied(input_ids=x, labels=labels, token_logps=True, token_entropy=True).loss

    for got in run_emulated(2, one_rank):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
