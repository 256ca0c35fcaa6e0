"""A pretrained directory is read under the model's own names, as ``from_pretrained`` reads it: GPT-NeoX stores its
head as ``embed_out`` (save_pretrained writes it so, and every Pythia on the Hub has it); a key transformers would
convert beyond a rename is refused by name."""

import pytest
import torch

from lightning_seqpar.hf.checkpoint_keys import checkpoint_key_renamer
from lightning_seqpar.hf.weights import SafetensorsStateDict
from tests.helpers.hf_models import HFCausalLM


def test_stored_names_become_the_model_s_keys(tmp_path):
    model = HFCausalLM(family="gpt_neox").model
    model.save_pretrained(tmp_path)
    stored = SafetensorsStateDict(tmp_path, "model.")
    assert "model.embed_out.weight" in stored and "model.lm_head.weight" not in stored  # as transformers writes it
    renamed = SafetensorsStateDict(tmp_path, "model.", checkpoint_key_renamer(model))
    assert sorted(renamed) == sorted(f"model.{k}" for k in model.state_dict())
    torch.testing.assert_close(renamed["model.lm_head.weight"].read(), model.lm_head.weight.detach())
    assert checkpoint_key_renamer(torch.nn.Linear(2, 2)) is None  # not a transformers model: names as stored


def test_a_key_transformers_converts_beyond_a_rename_is_refused_by_name():
    import transformers

    config = transformers.MixtralConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    rename = checkpoint_key_renamer(model)
    with pytest.raises(ValueError, match=r"stores 'model\.layers\.0\.mlp\.experts\.0\.w1\.weight' in a layout "
                                         r"transformers converts"):
        rename("model.layers.0.mlp.experts.0.w1.weight")
