"""Accepted means correct on the whole model: before training, a small copy of a Hugging Face causal LM runs through
its own forward as ``model(input_ids=x, labels=x)``, once as it is and once rewritten on emulated tensor-parallel ranks;
what differs is refused, naming the part and the setting. Tested through ``explain``, which runs the strategy's checks."""

import pytest
import torch.nn as nn

from lightning_seqpar import explain
from tests.helpers.models import build


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma", "smollm3"])
def test_the_supported_families_pass_the_whole_model_check(family):
    plan = explain(build("hf", family=family), tp=2)
    assert [e.policy.role for e in plan.entries] == ["vocabulary", "layer", "layer"]


def test_the_check_finds_gemmas_embedding_scale_and_smollm3s_layers_without_rotary(monkeypatch):
    """What the per-block check missed: each is refused, at the part where it first differs, when not implemented."""
    import lightning_seqpar.hf.layouts as layouts
    import lightning_seqpar.tensor_parallel.embedding as embedding

    monkeypatch.setattr(embedding, "embedding_scale", lambda e: None)  # the vocabulary-parallel embedding unscaled
    with pytest.raises(ValueError, match=r"model \(GemmaForCausalLM\): its tensor-parallel version does not compute "
                                         r"what the model computes.*first part whose output differs is "
                                         r"model\.embed_tokens"):
        explain(build("hf", family="gemma"), tp=2)
    monkeypatch.undo()
    spec = layouts.llama_block_spec
    monkeypatch.setattr(layouts, "llama_block_spec",
                        lambda m: __import__("dataclasses").replace(spec(m), rotary="apply_rotary_pos_emb"))
    with pytest.raises(ValueError, match=r"first part whose output differs is model\.layers\.1 "):  # the NoPE layer
        explain(build("hf", family="smollm3"), tp=2)


@pytest.mark.parametrize("family, setting", [("olmo", r"config\.clip_qkv=0\.5 \(with its default None")])
def test_a_difference_is_refused_naming_the_setting_responsible(family, setting):
    with pytest.raises(ValueError, match=r"does not compute what the model computes.*first part whose output differs "
                                         r"is model\.layers\.0 .*Settings the rewrite does not implement: " + setting) as error:
        explain(build("hf", family=family), tp=2)
    assert "verify=False" not in str(error.value)  # no refusal recommends turning the check off


def _tiny(config_class, **extra):
    from transformers import AutoModelForCausalLM

    config = config_class(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, pad_token_id=None, bos_token_id=None, eos_token_id=None, **extra)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family, reasons", [
    ("BloomConfig", r"BloomBlock: fused query_key_value \(q, k and v in one projection\); MLP of "
                    r"\['dense_h_to_4h', 'gelu_impl', 'dense_4h_to_h'\]"),
    ("PhimoeConfig", r"PhimoeDecoderLayer: mixture of experts of \['router', 'experts'\] \(not a router module "
                     r"`gate` or `router` with packed `experts`"),
    ("OPTConfig", r"OPTDecoderLayer: attention output not o_proj/dense \(attention has \['k_proj', 'v_proj', 'q_proj', "
                  r"'out_proj'\]\)"),
    ("GPTBigCodeConfig", r"GPTBigCodeBlock: fused c_attn \(q, k and v in one projection\)"),
])
def test_a_model_nothing_recognizes_is_refused_with_each_block_class_and_why(family, reasons):
    import transformers

    with pytest.raises(ValueError, match=r"No transformer block .* why none is known: " + reasons) as error:
        explain(_tiny(getattr(transformers, family)), tp=2)
    known = str(error.value).split("Known blocks: ")[1].split(".")[0]
    assert "ForCausalLM" not in known  # the model class is not a block


@pytest.mark.parametrize("family", ["StableLmConfig", "PhiConfig", "NemotronConfig", "Starcoder2Config", "ArceeConfig"])
def test_partial_rotary_and_the_llama_family_s_other_mlps_pass_the_whole_model_check(family):
    import transformers

    explain(_tiny(getattr(transformers, family)), tp=2)  # StableLM rotates 1/4 of each head: checked with 8 per head


def test_a_part_that_fails_in_the_check_is_refused_cleanly_naming_it(monkeypatch):
    import lightning_seqpar.hf.layouts as layouts

    spec = layouts.llama_block_spec
    monkeypatch.setattr(layouts, "llama_block_spec",  # a head size the projections do not have
                        lambda m: __import__("dataclasses").replace(spec(m), head_dim=3))
    with pytest.raises(ValueError, match=r"model \(LlamaForCausalLM\): its tensor-parallel version fails at "
                                         r"model\.layers\.0 on a small input at tp=2: RuntimeError"):
        explain(build("hf"), tp=2)


def test_a_tied_lm_head_with_a_bias_of_its_own_is_refused_with_the_fix():
    from transformers import PhiConfig

    with pytest.raises(ValueError, match=r"LM head is tied to the embedding and has a bias of its own.*"
                                         r"tie_word_embeddings=False"):
        explain(_tiny(PhiConfig, tie_word_embeddings=True), tp=2)


def test_one_extra_norm_around_the_mlp_is_refused_by_name():
    import transformers

    model = _tiny(transformers.LlamaConfig)
    layer = model.model.layers[0]
    layer.pre_feedforward_layernorm = type(layer.input_layernorm)(16)  # Gemma 2 has it with post_feedforward_layernorm
    with pytest.raises(ValueError, match=r"model\.layers\.0 \(LlamaDecoderLayer\): the Llama layout's parallel block "
                                         r"does not implement extra norms around the MLP"):
        explain(model, tp=2)


def test_a_one_norm_layer_of_no_known_layout_is_refused_for_what_it_lacks_not_for_its_parallel_residual():
    import transformers

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = nn.Linear(16, 2), nn.ModuleList([nn.Linear(16, 16)])

    model = _tiny(transformers.CohereConfig)  # attention and MLP from one norm: a parallel residual, accepted
    for layer in model.model.layers:
        layer.mlp = Experts()
    with pytest.raises(ValueError, match=r"why none is known: CohereDecoderLayer: mixture of experts of \['router', "
                                         r"'experts'\] \(not a router module `gate` or `router`.*\); Linear") as error:
        explain(model, tp=2)
    assert "parallel residual" not in str(error.value)


def _without(model, attribute, rename=None):
    for layer in model.model.layers:
        owner, name = (layer.self_attn, attribute.split(".")[1]) if "." in attribute else (layer, attribute)
        if rename:
            setattr(owner, rename, getattr(owner, name))
        delattr(owner, name)
    return model


@pytest.mark.parametrize("config, change, reason", [
    ("LlamaConfig", ("self_attn.q_proj", "query"), r"attention projections \['k_proj', 'v_proj', 'o_proj', 'query'\] "
                                                  r"\(not q_proj/k_proj/v_proj\)"),
    ("Olmo2Config", ("post_attention_layernorm", None), r"post-norms other than OLMo 2's"),
])
def test_each_remaining_layout_reason_is_named(config, change, reason):
    import transformers

    model = _without(_tiny(getattr(transformers, config)), *change)
    with pytest.raises(ValueError, match=rf"why none is known: \w+DecoderLayer: {reason}"):
        explain(model, tp=2)


@pytest.mark.parametrize("setting, message", [
    (dict(alibi=True, multi_query=False), r"Falcon's alibi=True \(ALiBi position biases, Falcon-RW\) is not supported"),
    (dict(hidden_dropout=0.1), r"Falcon's hidden_dropout=0\.1 is not supported .* set it to 0\.0"),
    (dict(attention_dropout=0.1), r"Falcon's attention_dropout=0\.1 is not supported"),
])
def test_falcon_settings_the_parallel_block_does_not_implement_are_refused_by_name(setting, message):
    import transformers

    config = transformers.FalconConfig(vocab_size=13, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                       pad_token_id=None, bos_token_id=None, eos_token_id=None, **setting)
    with pytest.raises(ValueError, match=message):
        explain(transformers.AutoModelForCausalLM.from_config(config), tp=1)


@pytest.mark.parametrize("option", ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"])
def test_gpt2_options_the_parallel_block_does_not_implement_are_refused_by_name(option):
    import transformers

    config = transformers.GPT2Config(vocab_size=13, n_embd=16, n_layer=2, n_head=4, **{option: True})
    with pytest.raises(ValueError, match=rf"GPT-2's {option}=True is not supported under tensor parallelism; set it "
                                         rf"to False"):
        explain(transformers.AutoModelForCausalLM.from_config(config), tp=2)
