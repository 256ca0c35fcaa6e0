"""Core attention dropout draws from the stream its heads need."""

import torch


def test_attention_dropout_differs_across_head_shards():
    """Core attention dropout on sharded heads draws from the per-rank stream."""
    from lightning_seqpar.parallel.random import RNGTracker
    from lightning_seqpar.transformer.core_attention import CoreAttention

    q = torch.ones(1, 2, 8, 4)
    v = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    masks = []
    for tp_rank in (0, 1):
        torch.manual_seed(0)  # the default generator agrees across ranks
        attn = CoreAttention(0.5, rng_tracker=RNGTracker.for_tensor_parallel(0, tp_rank), sharded_heads=True).train()
        masks.append(attn(q, q, v))
    assert not torch.equal(masks[0], masks[1])
    outputs = []
    for tp_rank in (0, 1):
        torch.manual_seed(0)
        attn = CoreAttention(0.5, rng_tracker=RNGTracker.for_tensor_parallel(0, tp_rank), sharded_heads=False).train()
        outputs.append(attn(q, q, v))
    assert torch.equal(outputs[0], outputs[1])  # replicated heads: the shared default generator
