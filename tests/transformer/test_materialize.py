"""A model built on the meta device is materialized block by block, identically on every rank."""

import pytest
import torch
import torch.nn as nn

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.placement import shard_spec
from lightning_seqpar.transformer.materialize import Materializer

CONFIG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=16, tie_weights=False)


def _meta_root(kind):
    with torch.device("meta"):
        root = nn.Module()
        if kind == "gpt":
            root.gpt = GPT(CONFIG)
        elif kind == "layers":  # rewritten one by one by the layer policy
            root.layers = nn.ModuleList([nn.TransformerEncoderLayer(16, 4, 32, norm_first=True) for _ in range(2)])
        else:
            root.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, norm_first=True), 2,
                                                 norm=nn.LayerNorm(16), enable_nested_tensor=False)
    return root


def _rewritten(kind, tp, rank, drop_layer=None):
    root = _meta_root(kind)
    materializer = Materializer(seed=5)
    group = ParallelGroup.virtual(tp, rank)
    rewrite(root, RewriteContext(group, True, None, True, materializer))
    if drop_layer is not None:  # what the stage split does to another stage's layer
        root.gpt.transformer.h[drop_layer] = nn.Identity()
    materializer.fill(root, group)
    return root


@pytest.mark.parametrize("kind", ["gpt", "encoder", "layers"])
def test_every_rank_slices_the_same_full_tensors(kind):
    whole = dict(_rewritten(kind, 1, 0).named_parameters())
    shards = [dict(_rewritten(kind, 2, r).named_parameters()) for r in (0, 1)]
    assert not any(p.is_meta for p in whole.values())
    for name, full in whole.items():
        spec = shard_spec(shards[0][name])
        got = spec.unshard([s[name].detach() for s in shards]) if spec is not None else shards[1][name].detach()
        torch.testing.assert_close(got, full.detach(), rtol=0, atol=0)


def test_each_module_is_initialized_by_the_models_own_scheme():
    params = dict(_rewritten("gpt", 1, 0).named_parameters())
    assert torch.equal(params["gpt.transformer.h.0.ln_1.weight"], torch.ones(16))
    assert torch.equal(params["gpt.transformer.h.0.attn.c_attn.bias"], torch.zeros(48))
    assert params["gpt.transformer.h.1.mlp.c_fc.weight"].std().item() == pytest.approx(0.02, rel=0.15)
    assert params["gpt.transformer.h.1.mlp.c_proj.weight"].std().item() == pytest.approx(0.01, rel=0.15)  # 0.02/√(2L)


def test_layers_of_other_pipeline_stages_are_never_materialized(monkeypatch):
    materialized = []
    real_into = Materializer.into
    monkeypatch.setattr(Materializer, "into", lambda self, parallel, original, name, *a: (
        materialized.append(name), real_into(self, parallel, original, name, *a))[1])
    root = _rewritten("gpt", 2, 0, drop_layer=1)
    assert materialized == ["transformer.h.0"]
    assert not any(p.is_meta for p in root.parameters())
