"""A 128k-token vocabulary split over tp: the bytes a Hugging Face causal LM keeps for backward outside its decoder
layers (embedding, LM head, loss with ``labels=``), measured live (float32)."""

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

V, H, S, B = 128256, 64, 64, 2


def _kept_outside_layers(rank, world_size):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_seqpar import ParallelGroup, RewriteContext, rewrite
    from lightning_seqpar.memory.tracker import LiveActivationTracker

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=S, attn_implementation="eager")
    holder = torch.nn.Module()
    holder.model = AutoModelForCausalLM.from_config(config)
    if world_size > 1:
        rewrite(holder, RewriteContext(ParallelGroup(torch.distributed.group.WORLD), True, None, True))
    x = torch.randint(0, V, (B, S))
    with LiveActivationTracker(holder) as tracker:
        loss = holder.model(input_ids=x, labels=x).loss  # as a training step calls it: the output is dropped
    kept = sum(r.nbytes for r in tracker.live() if not r.module.startswith("model.model.layers"))
    loss.backward()  # and it trains
    return kept


def test_a_split_vocabulary_keeps_about_one_tth_of_the_vocabulary_bytes_for_backward():
    one_process = run_distributed(_kept_outside_layers, 1)[0]
    per_rank = run_distributed(_kept_outside_layers, 2)
    logits_bytes = B * S * V * 4
    assert one_process >= logits_bytes  # one device keeps the [b, s, v] float32 log-probabilities
    for kept in per_rank:
        print(f"kept outside the layers: {kept / 2**20:.1f} MiB per rank at tp 2, {one_process / 2**20:.1f} MiB on one "
              f"device ({kept / one_process:.3f}x)")
        assert kept <= 0.55 * one_process
