"""What LoRA under the strategy does not compute is refused before training, naming the module and the fix; what it
accepts is rewritten with PEFT's names and the right split (one process, no communication)."""

import peft  # the test extra installs it; the library itself never imports it
import pytest
import torch

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar import explain
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.parallel.placement import is_sequence_parallel, shard_spec
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


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tests.helpers.chat_tokenizer import make_chat_model_dir

    return make_chat_model_dir(tmp_path_factory.mktemp("base") / "model")


def test_lora_targets_that_match_no_module_are_refused_listing_the_linear_names(chat_model):
    from lightning_seqpar.models.finetune import FineTuneModule

    with pytest.raises(ValueError, match=r"LoRA target_modules \['wq', 'w_gate'\] match no module of "
                                         r"LlamaForCausalLM.*named down_proj, gate_proj, k_proj, lm_head, o_proj, "
                                         r"q_proj, up_proj, v_proj; set peft.target_modules"):
        FineTuneModule(str(chat_model), {"target_modules": ["q_proj", "wq", "w_gate"]})
    FineTuneModule(str(chat_model), {"target_modules": ["q_proj", "down_proj"]})  # both exist: accepted


def _adapter_of(model_dir, out, hidden):
    """A PEFT adapter saved for a base of ``hidden`` (the chat base's shape when equal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size, config.intermediate_size = hidden, 2 * hidden
    config._name_or_path = f"another-base-{hidden}"
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    model.save_pretrained(out, save_embedding_layers=False)  # no lookup of the named base
    return out


def test_an_adapter_of_another_base_or_damaged_is_refused_naming_it_before_training(chat_model, tmp_path):
    from lightning_seqpar.checkpoint.destination import mark_export
    from lightning_seqpar.models.finetune import FineTuneModule

    other = _adapter_of(chat_model, tmp_path / "other", hidden=16)
    with pytest.raises(ValueError, match=rf"The adapter {other} was made for another-base-16: its "
                                         r"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight is \[2, 32\], "
                                         r"but this base \(.*model\) needs \[2, 64\] for "
                                         r"model.layers.0.mlp.down_proj \(r=2\)"):
        FineTuneModule(str(chat_model), adapter=str(other))
    good = _adapter_of(chat_model, tmp_path / "good", hidden=32)
    assert FineTuneModule(str(chat_model), adapter=str(good)).lora["r"] == 2
    mark_export(good, "adapter", digests=True)  # as export_peft_adapter writes it
    weights = good / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in the last tensor's data: the header still reads
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors differs from what was exported \(its SHA-256"):
        FineTuneModule(str(chat_model), adapter=str(good))
    weights.write_bytes(b"\xff" * 16 + bytes(data[16:]))
    (good / ".lightning_seqpar_export").unlink()  # not ours: the header is what tells
    with pytest.raises(ValueError, match=r"adapter_model.safetensors cannot be read as safetensors: its header is "
                                         r"damaged"):
        FineTuneModule(str(chat_model), adapter=str(good))
    with pytest.raises(FileNotFoundError, match=r"is not a PEFT adapter directory: it has no adapter_config.json"):
        FineTuneModule(str(chat_model), adapter=str(tmp_path))


def test_a_missing_base_or_base_file_is_refused_naming_it(chat_model, tmp_path):
    import shutil

    from lightning_seqpar.data.tokenizer import load_tokenizer
    from lightning_seqpar.models.finetune import FineTuneModule

    gone = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"No tokenizer at {gone}: the directory does not exist"):
        load_tokenizer(str(gone))
    with pytest.raises(FileNotFoundError, match=rf"No model directory at {gone}"):
        FineTuneModule(str(gone), {"r": 2})
    copy = tmp_path / "copy"
    shutil.copytree(chat_model, copy)
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{copy} holds no weights"):
        FineTuneModule(str(copy), {"r": 2})
    (copy / "model-00002-of-00002.safetensors").write_bytes(b"")
    (copy / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    with pytest.raises(FileNotFoundError, match=r"lacks \['model-00001-of-00002.safetensors'\], named by its "
                                                r"model.safetensors.index.json"):
        FineTuneModule(str(copy), {"r": 2})
