"""A model's inventory read without building more than it must: a model the planner built for itself is rewritten in
place (no meta-device copy), the fused-attention hint's inventory is the eager one's with the kernel changed, and an
inventory kept on disk beside the probes' fits is read back instead of built (a damaged file is built again). Each is
checked equal, field by field and by its probes' key, to the inventory read the long way."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_seqpar.plan import model_inventory
from lightning_seqpar.plan.__main__ import main
from lightning_seqpar.plan.measuring.fit_cache import FitCache
from lightning_seqpar.plan.measuring.models import (
    inventory_of_hf_model, load_model_config, meta_model, with_attention, with_lora,
)

LLAMA = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64)
ODD_MOE = dict(MOE, moe_intermediate_size=15)  # an expert width two ranks cannot split: whole experts


def _fields(inventory) -> dict:
    values = {f.name: getattr(inventory, f.name) for f in dataclasses.fields(inventory)
              if f.name not in ("config", "training", "_derived")}
    return dict(values, probe_key=inventory.probe_key)


@pytest.mark.parametrize("config, lora", [(LLAMA, None), (LLAMA, 4), (MOE, None), (ODD_MOE, None)],
                         ids=["llama", "llama-lora", "moe", "moe-whole-experts"])
def test_a_consumed_model_gives_the_inventory_of_a_copied_one(config, lora):
    def built():
        model = meta_model(load_model_config(config))
        return with_lora(model, lora, ["q_proj", "down_proj"]) if lora else model

    kept = built()
    layer = type(kept.get_decoder().layers[0] if lora is None else kept.base_model.model.model.layers[0])
    copied = inventory_of_hf_model(kept)
    assert type(kept.get_decoder().layers[0] if lora is None else kept.base_model.model.model.layers[0]) is layer
    consumed = inventory_of_hf_model(built(), consume=True)
    assert _fields(consumed) == _fields(copied)
    assert consumed.training == copied.training and consumed.config.to_dict() == copied.config.to_dict()
    splits = {e.split for e in copied.entries}
    if config is MOE:
        assert "expert_width" in splits
    if config is ODD_MOE:
        assert "expert" in splits and "expert_width" not in splits


@pytest.mark.parametrize("config", [LLAMA, MOE, "gpt-22b"], ids=["llama", "moe", "gpt"])
def test_another_kernel_s_inventory_is_the_one_built_with_it(config):
    eager = model_inventory(config, 128)
    built = model_inventory(config, 128, attention="sdpa")
    derived = with_attention(eager, load_model_config(config, 128), "sdpa")
    assert _fields(derived) == _fields(built) and not derived.eager_attention
    assert derived.probe_key != eager.probe_key
    assert derived.config.to_dict() == built.config.to_dict()
    back = with_attention(derived, load_model_config(config, 128), "eager")
    assert _fields(back) == _fields(eager)


def test_the_fused_attention_hint_builds_no_model_of_its_own(tmp_path, capsys, monkeypatch):
    import lightning_seqpar.plan.__main__ as cli

    asked = []

    def counted(*args, **kwargs):
        asked.append(args[2] if len(args) > 2 else kwargs.get("attention", "eager"))
        return model_inventory(*args, **kwargs)

    monkeypatch.setattr(cli, "model_inventory", counted)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, hidden_size=4096, num_hidden_layers=64)))
    main([str(tmp_path), "--gpus", "2", "--gpu-memory", "8GB", "--seq-len", "4096", "--global-batch", "8",
          "--analytic", "--no-cache", "--lora", "16"])
    out = capsys.readouterr().out
    assert "No layout fits" in out and "--attention sdpa" in out
    assert asked == ["eager"]


@pytest.mark.parametrize("config, kwargs", [
    (LLAMA, {}), (LLAMA, dict(lora=4, lora_targets=("q_proj", "down_proj"))), (LLAMA, dict(frozen=("embed_tokens",))),
    (MOE, {}), (MOE, dict(lora=4, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))), ("gpt-22b", {})],
    ids=["llama", "llama-lora", "llama-frozen", "moe", "moe-lora", "gpt"])
def test_an_inventory_kept_on_disk_reads_back_as_built(tmp_path, monkeypatch, config, kwargs):
    from lightning_seqpar.plan.measuring import models

    built = model_inventory(config, 128, cache=FitCache(tmp_path, salt="a"), **kwargs)
    monkeypatch.setattr(models, "meta_model", None)  # read, not built
    again = FitCache(tmp_path, salt="a")
    read = model_inventory(config, 128, cache=again, **kwargs)
    assert again.inventories_read == 1 and again.read == 0
    assert _fields(read) == _fields(built)  # the probes' key too: the config and the trained parts as built
    assert read.config.to_dict() == built.config.to_dict()
    if kwargs:  # the same LoRA settings (as PEFT left them after wrapping) and frozen names
        assert read.training.key == built.training.key and read.training.frozen == built.training.frozen
    else:
        assert read.training is built.training is None


@pytest.mark.parametrize("damage", ["split", "size", "half", "lora"])
def test_a_damaged_inventory_file_is_built_again(tmp_path, damage):
    lora = dict(lora=4, lora_targets=("q_proj",)) if damage == "lora" else {}
    model_inventory(LLAMA, 128, cache=FitCache(tmp_path, salt="a"), **lora)
    (path,) = tmp_path.glob("*.json")
    stored = json.loads(path.read_text())
    if damage == "split":
        stored["fields"]["entries"][0][2] = "diagonal"
    elif damage == "size":
        stored["fields"]["sizes"][1] = -32
    elif damage == "lora":
        stored["fields"]["lora"] = json.dumps({"r": 4, "no_such_setting": 1})
    text = json.dumps(stored)
    path.write_text(text[:len(text) // 2] if damage == "half" else text)
    again = FitCache(tmp_path, salt="a")
    rebuilt = model_inventory(LLAMA, 128, cache=again, **lora)
    assert again.inventories_written == 1 and again.inventories_read == (damage == "lora")  # read, then refused
    assert _fields(rebuilt) == _fields(model_inventory(LLAMA, 128, **lora))


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_an_inventory_read_back_probes_as_the_built_one(tmp_path):
    from lightning_seqpar.plan import plan

    kwargs = dict(lora=4, lora_targets=("q_proj", "o_proj"))  # PEFT's settings as it left them, applied to the probes
    built = model_inventory(MOE, 128, cache=FitCache(tmp_path, salt="a"), **kwargs)
    read = model_inventory(MOE, 128, cache=FitCache(tmp_path, salt="a"), **kwargs)
    ask = dict(precision="bf16-mixed", context_parallel=(1,), schedule=("1F1B",))
    records = [plan(inventory, 2, 128, 4, fits={}, **ask) for inventory in (built, read)]
    assert [r.bytes for r in records[0]] == [r.bytes for r in records[1]]
    assert sum(bool(r.bytes) for r in records[0]) > 0
