"""Vocabulary parallelism checked on emulated tensor-parallel ranks (threads of this process): the fused
vocabulary-parallel cross entropy, and a Hugging Face causal LM whose embedding, head and loss are split."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_seqpar.tensor_parallel.vocab_logits import VocabShardedLogits
from tests.helpers.models import VOCAB, build, token_data


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_fused_loss_equals_cross_entropy_on_the_whole_vocabulary(t, smoothing, reduction):
    torch.manual_seed(0)
    v = 13  # padded to a multiple of t
    full = torch.randn(3, 5, v, dtype=torch.float64)
    target = torch.randint(0, v, (3, 5))
    target[0, :2] = -100
    reference = full.clone().requires_grad_()
    want = F.cross_entropy(reference.reshape(-1, v), target.reshape(-1), label_smoothing=smoothing, reduction=reduction)
    want = want.reshape(3, 5).masked_fill(target == -100, 0.0) if reduction == "none" else want
    want.sum().backward()
    padded = F.pad(full, (0, -v % t))

    def one_rank(group):
        local = padded.chunk(t, -1)[group.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group, v, label_smoothing=smoothing, reduction=reduction)
        loss.sum().backward()
        return loss.detach(), local.grad

    ranks = run_emulated(t, one_rank)
    grad = torch.cat([g for _, g in ranks], dim=-1)
    for loss, _ in ranks:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad[..., :v], reference.grad, rtol=1e-12, atol=1e-12)
    assert grad[..., v:].abs().max() == 0 if grad.shape[-1] > v else True  # padding columns get no gradient


@pytest.mark.parametrize("family, tie", [("llama", True), ("llama", False), ("gpt2", True), ("gemma2", True),
                                         ("cohere", True), ("phi", False), ("gpt_neox", False)])
def test_a_causal_lm_with_a_split_vocabulary_gives_the_one_device_loss_logits_and_gradients(family, tie):
    reference = build("hf", family=family, tie=tie).model.double()
    x = token_data(1, 1).tensors[0]
    out = reference(input_ids=x, labels=x)
    out.loss.backward()
    want_grad = reference.get_input_embeddings().weight.grad

    def one_rank(group):
        holder = nn.Module()
        holder.model = copy.deepcopy(reference)
        holder.model.zero_grad()
        rewrite(holder, RewriteContext(group, True, None, True))
        result = holder.model(input_ids=x, labels=x)
        result.loss.backward()
        logits = result.logits
        unread = isinstance(logits, VocabShardedLogits) and logits.full is None and logits.shape == out.logits.shape
        embedding = holder.model.get_input_embeddings().weight
        return (result.loss.detach(), logits.detach() * 1, embedding.grad.clone(), unread,
                holder.model.lm_head.weight is embedding, embedding.shape[0])

    ranks = run_emulated(2, one_rank)
    grad = torch.cat([r[2] for r in ranks])[:VOCAB]
    for loss, logits, _, unread, tied, rows in ranks:
        assert unread and tied == tie and rows == -(-VOCAB // 2)  # 13 rows padded to 14: 7 per rank
        # transformers' loss upcasts to float32: equal to float32 rounding
        torch.testing.assert_close(loss, out.loss.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(logits, out.logits.detach(), rtol=1e-12, atol=1e-12)
    assert ((grad - want_grad).norm() / want_grad.norm()).item() < 1e-5  # float32 rounding of the loss, as above


def test_sharded_logits_read_as_the_single_device_tensor_and_gather_once():
    local = torch.arange(12.0).reshape(1, 2, 6)

    def one_rank(group):
        logits = VocabShardedLogits.wrap(local + 100 * group.rank, group, 11)
        metadata = (tuple(logits.shape), logits.size(-1), logits.dim(), logits.dtype, logits.full is None)
        first, second = logits[0, 1], logits.sum()
        return metadata, first, second, logits.full is not None

    for metadata, first, second, cached in run_emulated(2, one_rank):
        assert metadata == ((1, 2, 11), 11, 3, torch.float32, True) and cached
        assert first.tolist() == [6, 7, 8, 9, 10, 11, 106, 107, 108, 109, 110]
