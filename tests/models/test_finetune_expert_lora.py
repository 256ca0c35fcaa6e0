"""LoRA on a mixture's experts as the fine-tuning module sets it up (``recipes/finetune.py peft=lora``):
``target_modules="all-linear"`` adapts the experts' packed weights too, in every family (PEFT's own rule skips
gpt-oss's and Qwen2-MoE's); ``target_parameters`` that name nothing are refused before any process starts, listing
the model's packed weights; an adapter directory of expert adapters is checked against its base (its shapes
``[r·E, in]`` and ``[out, r·E]``) and continues with its own targets."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.checkpoint.peft_adapter import check_adapter_directory
from lightning_seqpar.models.finetune import FineTuneModule
from tests.helpers.hf_models import moe_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)


def _model_dir(path, family):
    torch.manual_seed(0)
    config = moe_config(family, COMMON) if family != "llama" else transformers.LlamaConfig(**COMMON)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe", "qwen3_moe"])
def test_all_linear_on_a_mixture_adapts_its_experts(tmp_path, family):
    module = FineTuneModule(_model_dir(tmp_path, family), lora={"r": 2, "target_modules": "all-linear"})
    assert module.lora["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = module.declared_model()
    adapted = {name.split(".layers.0.")[-1] for name, _ in model.named_parameters()
               if ".layers.0." in name and ".lora_A." in name}
    assert {"mlp.experts.lora_A.default.weight", "mlp.experts.base_layer.lora_A.default.weight"} <= adapted, adapted


def test_all_linear_on_a_dense_model_adds_no_parameter_targets(tmp_path):
    module = FineTuneModule(_model_dir(tmp_path, "llama"), lora={"r": 2, "target_modules": "all-linear"})
    assert module.lora["target_parameters"] is None


def test_parameter_targets_that_name_nothing_are_refused_with_the_model_s_packed_weights(tmp_path):
    with pytest.raises(ValueError, match=r"target_parameters \['mlp.experts.up_proj'\] match no parameter of "
                                         r"Qwen3MoeForCausalLM\. Its packed expert weights are "
                                         r"\['mlp.experts.down_proj', 'mlp.experts.gate_up_proj'\]"):
        FineTuneModule(_model_dir(tmp_path, "qwen3_moe"),
                       lora={"r": 2, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.up_proj"]})


def test_an_expert_adapter_directory_is_checked_against_its_base_and_keeps_its_targets(tmp_path):
    base_dir = _model_dir(tmp_path / "base", "qwen3_moe")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                                  "mlp.experts.down_proj"])
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    saved = check_adapter_directory(tmp_path / "adapter", transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                    base_dir)
    assert sorted(saved["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    module = FineTuneModule(base_dir, adapter=str(tmp_path / "adapter"))
    assert module.lora["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    wider = transformers.AutoModelForCausalLM.from_config(moe_config("qwen3_moe", dict(COMMON, hidden_size=32)))
    with pytest.raises(ValueError, match=r"mlp.experts.base_layer.lora_A.weight is \[16, 16\], but this base .* "
                                         r"needs one of"):
        check_adapter_directory(tmp_path / "adapter", wider, "a wider base")
