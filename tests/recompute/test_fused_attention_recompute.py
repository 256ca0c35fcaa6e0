"""Selective recomputation says so when a layer's attention is a fused kernel, rather than silently doing nothing."""

import pytest
import torch

from lightning_seqpar import ParallelGroup, RewriteContext, SelectiveRecompute, rewrite
from lightning_seqpar.recompute import fused_attention_layers
from tests.helpers.models import build


def _rewritten(attn_implementation):
    module = build("hf", attn_implementation=attn_implementation)
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), False, None, True))
    return module


def test_fused_attention_layers_are_named_and_the_callback_warns():
    module = _rewritten("sdpa")
    assert len(fused_attention_layers(module)) == 2
    with pytest.warns(UserWarning, match=r"2 rewritten layer\(s\) use a fused attention kernel .* nothing to recompute"):
        SelectiveRecompute().on_fit_start(None, module)


def test_explicit_attention_is_checkpointed_without_a_warning(recwarn):
    module = _rewritten("eager")
    SelectiveRecompute().on_fit_start(None, module)
    assert not fused_attention_layers(module)
    assert not [w for w in recwarn if "fused attention" in str(w.message)]
    x = torch.randint(0, 13, (2, 8))
    module(x).sum().backward()  # runs with the core attention checkpointed
