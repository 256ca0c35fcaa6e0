"""The hub's per-expert tensors read as the model's packed experts: the key a model (or its PEFT wrapper) has, the
packed shape, and only the rows asked for; an incomplete directory is refused by name."""

import pytest
import torch

from lightning_seqpar.hf.checkpoint_keys import checkpoint_key_renamer, expert_piece_names
from lightning_seqpar.hf.weights import SafetensorsStateDict
from tests.helpers.hf_models import HFCausalLM


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    model = HFCausalLM(family="qwen3_moe").model
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("peft", [False, True])
def test_per_expert_tensors_read_as_the_packed_weight_under_the_model_s_key(saved, peft):
    model, directory = saved
    target = model
    if peft:
        from peft import LoraConfig, get_peft_model

        import copy
        target = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    prefix = "base_model.model." if peft else ""
    stored = SafetensorsStateDict(directory, "", checkpoint_key_renamer(target))
    want = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    packed = stored[f"{prefix}model.layers.1.mlp.experts.gate_up_proj"]
    assert tuple(packed.shape) == tuple(want.shape) == (8, 16, 16)
    torch.testing.assert_close(packed.rows(0, 2, 5), want[2:5], rtol=0, atol=0)  # experts 2-4 only
    torch.testing.assert_close(packed.read(), want, rtol=0, atol=0)
    torch.testing.assert_close(stored[f"{prefix}model.layers.1.mlp.experts.down_proj"].read(),
                               model.model.layers[1].mlp.experts.down_proj.detach(), rtol=0, atol=0)


def test_the_export_names_are_the_hub_s(saved):
    model, _ = saved
    names = expert_piece_names(model)("model.layers.0.mlp.experts.gate_up_proj", 3)
    assert names == [[f"model.layers.0.mlp.experts.{e}.gate_proj.weight", f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
                     for e in range(3)]
    assert expert_piece_names(model)("model.layers.0.mlp.gate.weight", 8) is None


def test_a_directory_missing_one_expert_s_tensor_is_refused_by_name(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    model, directory = saved
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"stores model\.layers\.0\.mlp\.experts\.gate_up_proj one tensor per expert, "
                                         r"and lacks expert 5 part 1"):
        SafetensorsStateDict(tmp_path, "", checkpoint_key_renamer(model))
