"""``save_hf_pretrained`` from tp 2 and pp 2 x tp 2: safetensors files with their index, the source directory's
config, tokenizer and generation files; ``from_pretrained`` reloads the trained weights exactly. (Peak memory while
exporting a 315M model: test_hf_meta_init.)"""

import json

import lightning.pytorch as pl
import pytest
import torch
import transformers

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models import HFCausalLMModule
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, VOCAB, loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=True)
FAMILIES = {
    "llama": dict(model_type="llama", hidden_size=16, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2 * SEQ, **COMMON),
    # fused c_attn as a Conv1D [h, 3h]: split per block along dim 1
    "gpt2": dict(model_type="gpt2", n_embd=16, n_head=4, n_positions=2 * SEQ, bos_token_id=0, eos_token_id=0, **COMMON),
    # fused qkv_proj [q; k; v] (k, v smaller: grouped-query) and gate_up_proj [gate; up]: split per block, exported fused
    "phi3": dict(model_type="phi3", hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2 * SEQ, pad_token_id=None, bos_token_id=None, eos_token_id=None, **COMMON),
    # query_key_value fused per head: split by whole heads
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=16, intermediate_size=32, num_attention_heads=4,
                     max_position_embeddings=2 * SEQ, pad_token_id=None, bos_token_id=None, eos_token_id=None, **COMMON),
    # norms around both branches; a bias on the LM head (sharded with the vocabulary)
    "gemma2": dict(model_type="gemma2", hidden_size=16, intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=4, max_position_embeddings=2 * SEQ, **COMMON),
    # q/k norms over all heads: their weights sharded like the projections
    "olmo2": dict(model_type="olmo2", hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2 * SEQ, pad_token_id=None, bos_token_id=None, eos_token_id=None, **COMMON),
    # query_key_value grouped per key/value head (Falcon's new decoder architecture)
    "falcon": dict(model_type="falcon", hidden_size=16, num_attention_heads=4, new_decoder_architecture=True,
                   num_kv_heads=2, max_position_embeddings=2 * SEQ, pad_token_id=None, bos_token_id=None,
                   eos_token_id=None, **COMMON),
    "phi": dict(model_type="phi", hidden_size=16, intermediate_size=32, num_attention_heads=4,
                max_position_embeddings=2 * SEQ, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                **{**COMMON, "tie_word_embeddings": False}),
}
LAYOUTS = {2: [("llama", 2, 1), ("gpt2", 2, 1), ("phi3", 2, 1), ("gpt_neox", 2, 1), ("gemma2", 2, 1), ("phi", 2, 1),
               ("olmo2", 2, 1), ("falcon", 2, 1)],
           4: [("llama", 2, 2), ("phi3", 2, 2)]}
TOKENIZER_CONFIG = '{"model_max_length": 16, "tokenizer_class": "PreTrainedTokenizerFast"}\n'


def _refusal(call):
    try:
        call()
    except FileExistsError as error:
        return str(error)
    return None


def _export(rank, world_size, root):
    refusals = {}
    for family, tp, pp in LAYOUTS[world_size]:
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=tp, pp=pp),
                             precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False)
        module = HFCausalLMModule(pretrained=f"{root}/{family}")  # on the meta device, read into the shards
        trainer.validate(module, loader(token_data(1, 1)), verbose=False)
        out = f"{root}/{family}-tp{tp}pp{pp}"
        trainer.strategy.save_hf_pretrained(out, max_shard_size="10KB")
        if family == "llama" and world_size == 2:  # what an export must not replace, then a replaced export
            refusals["again"] = _refusal(lambda: trainer.strategy.save_hf_pretrained(out))
            refusals["source"] = _refusal(lambda: trainer.strategy.save_hf_pretrained(f"{root}/{family}",
                                                                                       overwrite=True))
            refusals["user files"] = _refusal(lambda: trainer.strategy.save_hf_pretrained(f"{root}/mine"))
            trainer.strategy.save_hf_pretrained(out, max_shard_size="10KB", overwrite=True)
    return refusals


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    for family, config in FAMILIES.items():
        source = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
        source.save_pretrained(root / family, max_shard_size="20KB")
        transformers.GenerationConfig(max_new_tokens=7, do_sample=False).save_pretrained(root / family)
        (root / family / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("the user's")
    refusals = {world_size: run_distributed(_export, world_size, str(root)) for world_size in LAYOUTS}
    return root, refusals[2]


def test_an_export_replaces_only_a_previous_export_and_only_when_asked(exported):
    root, refusals = exported
    for rank in refusals:  # every rank refuses, before anything is written
        assert "holds a previous export. Pass --overwrite" in rank["again"]
        assert f"The export destination {root}/llama must be kept" in rank["source"]
        assert "holds files no export wrote (notes.txt)" in rank["user files"]
    assert (root / "mine" / "notes.txt").read_text() == "the user's"
    assert (root / "llama" / "config.json").is_file()


def exported_tied(family):
    return FAMILIES[family]["tie_word_embeddings"]


@pytest.mark.parametrize("family, tp, pp", [layout for layouts in LAYOUTS.values() for layout in layouts],
                         ids=lambda v: str(v))
def test_the_exported_directory_reloads_with_the_same_weights_and_logits(exported, family, tp, pp):
    exported = exported[0]
    out = exported / f"{family}-tp{tp}pp{pp}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == files
    tied = exported_tied(family)
    assert ("lm_head.weight" in index["weight_map"]) != tied  # tied: stored once, as save_pretrained does
    assert (out / "tokenizer_config.json").read_text() == TOKENIZER_CONFIG
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert not [p for p in exported.iterdir() if p.name.startswith(".")]  # no temporary left beside it

    source = transformers.AutoModelForCausalLM.from_pretrained(exported / family, dtype=torch.float64)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert reloaded.config.model_type == family
    for key, value in source.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    x = token_data(1, 1, seed=3).tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, source(input_ids=x).logits, rtol=0, atol=0)
