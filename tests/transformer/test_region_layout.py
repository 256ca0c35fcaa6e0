"""The tensor-parallel region is sequence-first in contiguous memory, forward and backward: a rewritten Hugging Face
layer keeps for backward exactly b times what it keeps for one sequence (a strided ``[s, b, h]`` view made every
linear copy its input again and keep the copy, three ``[s, b, h]`` more per layer at b > 1), the gradients inside
the region arrive contiguous whether its blocks are compiled or not, and under sequence parallelism no slice keeps a
whole ``[s, b, h]`` alive."""

import pytest
import torch

from lightning_seqpar.plan.measuring.models import meta_model
from lightning_seqpar.plan.measuring.probe import measure
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("tp, sequence_parallel", [(1, True), (2, False), (2, True)])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_layer_keeps_b_times_what_it_keeps_for_one_sequence(tp, sequence_parallel, family):
    options = LLAMA if family == "llama" else dict(model_type="gpt2", vocab_size=64, n_positions=64, n_embd=64,
                                                    n_layer=2, n_head=4)
    config = meta_model(options).config
    one, three = (measure(config, tp, sequence_parallel, "none", "32-true", 8 * tp, b).layer for b in (1, 3))
    assert three == 3 * one, (one, three)


def test_the_region_is_contiguous_both_ways():
    x = torch.randn(2, 6, 4, requires_grad=True)  # [b, s, h]
    inside = enter_parallel_region(x, ParallelGroup(), True, batch_first=True)  # [s, b, h]
    seen = []
    inside.register_hook(lambda grad: seen.append(grad.is_contiguous()))
    out = exit_parallel_region(inside * 2, ParallelGroup(), True, batch_first=True)
    assert inside.shape == (6, 2, 4) and inside.is_contiguous()
    weights = torch.randn(2, 6, 4)
    (out * weights).sum().backward()
    assert seen == [True]
    assert torch.equal(out, 2 * x) and torch.equal(x.grad, 2 * weights)
