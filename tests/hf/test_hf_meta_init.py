"""A Hugging Face model built on the meta device becomes, shard by shard, the model a normal build gives: its
own initializer for what is drawn, rotary buffers recomputed, tied embeddings still tied; pretrained weights are
read straight into the shards with nothing initialized first but the non-persistent buffers."""

import pytest
import torch
import torch.nn as nn
import transformers

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.hf.init import hf_initializers
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.transformer.materialize import Materializer

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _config(family: str, tie: bool):
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tie, initializer_range=0.05)
    if family == "llama3":
        return transformers.LlamaConfig(rope_parameters=LLAMA3_ROPE, **common)
    return transformers.Qwen3Config(**common)


def _materialize(config, initializers_wrapper=None, source=None) -> nn.Module:
    with torch.device("meta"):
        root = nn.Module()
        root.model = transformers.AutoModelForCausalLM.from_config(config)
    initializers = hf_initializers(root)
    if initializers_wrapper is not None:
        initializers = [(name, initializers_wrapper(init)) for name, init in initializers]
    group = ParallelGroup()
    materializer = Materializer(7, initializers=initializers, source=source)
    rewrite(root, RewriteContext(group, False, None, True, materializer))
    materializer.fill(root, group)
    return root.model


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_meta_built_model_has_the_buffers_ties_and_init_of_a_normal_build(family, tie):
    config = _config(family, tie)
    normal = transformers.AutoModelForCausalLM.from_config(config)
    model = _materialize(config)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert dict(model.named_buffers()).keys() == dict(normal.named_buffers()).keys()
    for name, buffer in normal.named_buffers():  # rotary inv_freq (llama3 scaling included) and kin
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert 0.03 < q_proj.std().item() < 0.07  # the config's initializer_range (0.05), not nn.Linear's default
    assert torch.equal(model.model.norm.weight, torch.ones(16))


def test_pretrained_weights_are_read_into_the_model_with_nothing_initialized_first():
    config = _config("llama3", tie=True)
    normal = transformers.AutoModelForCausalLM.from_config(config)
    source = {"model." + k: v for k, v in normal.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    initialized = []

    def counting(init):
        return lambda module, name: (initialized.append(name), init(module, name))

    model = _materialize(config, counting, source)
    assert initialized == ["model.model.rotary_emb"]  # non-persistent buffers only: never in a state dict
    for name, value in normal.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
