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


def test_per_expert_keys_are_read_as_pieces_and_other_conversions_are_refused_by_name(monkeypatch):
    import transformers
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    from lightning_seqpar.hf.checkpoint_keys import ExpertPiece

    config = transformers.MixtralConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    rename = checkpoint_key_renamer(model)  # Mixtral's hub names: block_sparse_moe, w1 (gate) / w3 (up)
    assert rename("model.layers.0.block_sparse_moe.experts.1.w3.weight") == ExpertPiece(
        "model.layers.0.mlp.experts.gate_up_proj", 1, 1, 2)
    split = WeightConverter(source_patterns="mlp.w13.weight", target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                            operations=[Chunk(dim=0)])  # a split, as some families' checkpoints need
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model: [split])
    rename = checkpoint_key_renamer(model)
    with pytest.raises(ValueError, match=r"stores 'model\.layers\.0\.mlp\.w13\.weight' in a layout "
                                         r"transformers converts"):
        rename("model.layers.0.mlp.w13.weight")
