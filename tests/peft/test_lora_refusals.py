"""What LoRA under the strategy does not compute is refused before training, naming the module and the fix; what it
accepts is rewritten with PEFT's names and the right split (one process, no communication)."""

import peft  # the test extra installs it; the library itself never imports it
import pytest
import torch

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.policies import explain, rewrite
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.tensor_parallel.sharding import is_sequence_parallel, shard_spec
from lightning_seqpar.transformer.lora import LoRAColumnParallelLinear, LoRARowParallelLinear
from tests.helpers.models import build



def _peft(family="llama", **config):
    module = build("hf", family=family, labels=True)
    config.setdefault("target_modules", ["q_proj", "v_proj", "o_proj", "down_proj"])
    module.model = peft.get_peft_model(module.model, peft.LoraConfig(r=2, lora_alpha=4, **config))
    return module


@pytest.mark.parametrize("config,match", [
    (dict(use_dora=True), r"self_attn\.\w+_proj.*DoRA \(use_dora=True\)"),
    (dict(lora_bias=True), r"LoRA biases \(lora_bias=True\)"),
    (dict(target_modules=["q_proj", "lm_head"]), r"lm_head: a PEFT adapter outside the transformer layers.*Remove "
                                                 r"'lm_head' from target_modules"),
    (dict(target_modules=["q_proj", "embed_tokens"]), r"embed_tokens: a PEFT adapter outside"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save .*remove it from the LoraConfig"),
])
def test_unsupported_lora_features_are_refused_naming_the_module(config, match):
    with pytest.raises(ValueError, match=match):
        explain(_peft(**config), tp=2)


def test_other_peft_methods_are_refused():
    module = build("hf", labels=True)
    module.model = peft.get_peft_model(module.model, peft.IA3Config(target_modules=["q_proj", "down_proj"],
                                                                     feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match=r"IA3.*only LoRA|only LoRA"):
        explain(module, tp=2)


def test_lora_on_gpt2s_conv1d_is_refused():
    module = build("hf", family="gpt2", labels=True)
    module.model = peft.get_peft_model(module.model, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                                     fan_in_fan_out=True))
    with pytest.raises(ValueError, match=r"c_attn.*Conv1D, not an nn.Linear"):
        explain(module, tp=2)


def test_two_active_adapters_are_refused():
    module = _peft()
    module.model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    module.model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match=r"2 active adapters"):
        explain(module, tp=2)


def test_the_split_follows_the_base_and_names_stay_pefts():
    module = _peft(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    single = {n: p.detach().clone() for n, p in module.named_parameters()}
    rewrite(module, RewriteContext(ParallelGroup.virtual(2)))
    layer = module.model.base_model.model.model.layers[0]
    q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
    assert isinstance(q, LoRAColumnParallelLinear) and isinstance(o, LoRARowParallelLinear)
    names = {n for n, _ in module.named_parameters()}
    assert names == set(single)  # base_layer.weight, lora_A.default.weight, lora_B.default.weight, as PEFT's
    prefix = "model.base_model.model.model.layers.0.self_attn"
    qa, qb = q.lora_A["default"].weight, q.lora_B["default"].weight
    oa, ob = o.lora_A["default"].weight, o.lora_B["default"].weight
    # column: A replicated (its gradient summed over tp under SP), B split by output rows like the base
    assert torch.equal(qa, single[f"{prefix}.q_proj.lora_A.default.weight"]) and shard_spec(qa) is None
    assert is_sequence_parallel(qa) and shard_spec(qb).dim == 0
    assert torch.equal(qb, single[f"{prefix}.q_proj.lora_B.default.weight"][:8])  # rank 0's half of 16 rows
    # row: A split by input columns like the base, B replicated (its gradient is partial: summed over tp)
    assert shard_spec(oa).dim == 1 and torch.equal(oa, single[f"{prefix}.o_proj.lora_A.default.weight"][:, :8])
    assert shard_spec(ob) is None and is_sequence_parallel(ob)
    assert not any(p.requires_grad for n, p in module.named_parameters() if "base_layer" in n)  # frozen stays frozen
    # LoRA dropout's stream: a column input under SP and a row input (features) differ across tp ranks.
    assert q.lora_dropout.sharded and o.lora_dropout.sharded


def test_without_sp_a_column_adapters_dropout_draws_alike_on_every_rank():
    module = _peft(target_modules=["q_proj", "o_proj"], lora_dropout=0.1)
    rewrite(module, RewriteContext(ParallelGroup.virtual(2), False))
    layer = module.model.base_model.model.model.layers[0]
    q, o = layer.self_attn.q_proj, layer.self_attn.o_proj
    assert q.lora_dropout.p == o.lora_dropout.p == 0.1
    assert not q.lora_dropout.sharded and o.lora_dropout.sharded  # replicated input: one mask; split features: own


def test_explain_names_the_adapters_their_split_and_the_frozen_parameters(capsys):
    plan = explain(_peft(target_modules=["q_proj", "o_proj"]), tp=2)
    detail = plan.entries[1].detail
    assert "LoRA r=2 on self_attn.q_proj/self_attn.o_proj" in detail and "1 r-sized all-gathers per layer" in detail
    assert "frozen parameters: no gradient, no optimizer state" in detail
