"""Masks are built once, not per layer: torch's masks passed to layers one by one are combined once per forward
(and again only when a mask changes); the causal mask is one cached ``[s, s]`` tensor."""

import copy

import torch
import torch.nn as nn

import lightning_seqpar.transformer.declared_block as declared_block
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
                                     for _ in range(3)])

    def forward(self, x, mask, padding):
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=padding)
        return x


def test_torch_masks_are_combined_once_per_forward_and_again_when_changed(monkeypatch):
    torch.manual_seed(0)
    model = Layers().double()
    reference = copy.deepcopy(model)
    rewrite(model, RewriteContext(ParallelGroup.virtual(1), False, None, True))
    built = []
    real = declared_block.torch_attention_bias
    monkeypatch.setattr(declared_block, "torch_attention_bias", lambda *a: built.append(1) or real(*a))
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, -1] = True
    for _ in range(2):
        torch.testing.assert_close(model(x, mask, padding), reference(x, mask, padding))
    assert len(built) == 1  # three layers, two forwards, the same masks: combined once
    padding[0, -2] = True  # changed in place: combined again
    torch.testing.assert_close(model(x, mask, padding), reference(x, mask, padding))
    assert len(built) == 2
    model(x, mask.clone(), padding)  # another mask tensor
    assert len(built) == 3


def test_the_causal_mask_is_one_tensor_per_length():
    attention = CoreAttention(causal=True)
    q = torch.randn(1, 2, 5, 4)
    attention(q, q, q)
    first = attention.future_mask(5, q.device)
    attention(q, q, q)
    assert attention.future_mask(5, q.device) is first and first.shape == (5, 5)
    assert copy.deepcopy(attention).future_mask._mask is None  # a cache: not copied with the module
