"""Under pp a Hugging Face causal LM's embedding lives on the first stage and its final norm and LM head on the last;
a tied embedding is held by those two stages only, its gradient summed between them (Megatron's embedding group).
Training parity for these layouts is in test_hf_models (pp 2, pp 2 x tp 2 tied and untied, pp 4 tied)."""

import pytest
import lightning.pytorch as pl
import torch.distributed as dist

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models import HFCausalLMModule
from lightning_seqpar.pipeline_parallel.placement import LastStageOnly, SkippedEmbedding
from lightning_seqpar.parallel.placement import is_pipeline_tied, is_stage_local
from tests.hf.test_hf_meta_init_on_ranks import CONFIG
from tests.helpers.distributed import run_distributed
from tests.helpers.models import loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _placement(rank, world_size, tie, tp=1):
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=tp, pp=4 // tp),
                         precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False)
    config = dict(CONFIG, num_hidden_layers=4, tie_word_embeddings=tie)
    module = HFCausalLMModule(config, learning_rate=1e-2)  # built on the meta device
    trainer.validate(module, loader(token_data(1, 1, batch=4), 4), verbose=False)
    model = module.model
    mesh = trainer.strategy.mesh
    embedding_ranks = dist.get_process_group_ranks(mesh.embedding.group) if mesh.embedding.group is not None else []
    return {
        "parts": {name: type(model.get_submodule(name)).__name__ for name in ("model.embed_tokens", "model.norm", "lm_head")},
        "keys": sorted(k for k in module.state_dict() if "layers" not in k),
        "tags": {name: ("tied" if is_pipeline_tied(p) else "local" if is_stage_local(p) else "everywhere")
                 for name, p in module.named_parameters() if "layers" not in name},
        "tied_is_one_tensor": getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", 0),
        "embedding_group": embedding_ranks,
        "remote": sorted(k for k in trainer.strategy.checkpointer.remote_keys if "layers" not in k),
    }


def test_embedding_on_the_first_stage_norm_and_head_on_the_last_tied_weight_on_both():
    skipped, last_only = SkippedEmbedding.__name__, LastStageOnly.__name__
    first, middle, _, last = run_distributed(_placement, 4, True)
    assert first["parts"] == {"model.embed_tokens": "Embedding", "model.norm": last_only, "lm_head": last_only}
    assert last["parts"] == {"model.embed_tokens": skipped, "model.norm": "LlamaRMSNorm", "lm_head": "Linear"}
    assert middle["parts"] == {"model.embed_tokens": skipped, "model.norm": last_only, "lm_head": last_only}
    # the first and the last stage hold the tied tensor under both keys, as one device does; middle stages nothing
    assert first["keys"] == ["model.lm_head.weight", "model.model.embed_tokens.weight"]
    assert last["keys"] == ["model.lm_head.weight", "model.model.embed_tokens.weight", "model.model.norm.weight"]
    assert middle["keys"] == [] and first["tied_is_one_tensor"] and last["tied_is_one_tensor"]
    assert not middle["tied_is_one_tensor"]
    assert first["tags"] == {"model.model.embed_tokens.weight": "tied"}
    assert last["tags"] == {"model.model.embed_tokens.weight": "tied", "model.model.norm.weight": "local"}
    assert first["embedding_group"] == last["embedding_group"] == [0, 3] and middle["embedding_group"] == []
    # a tied tensor is named once among the keys other stages hold (Hugging Face stores it once)
    assert middle["remote"] == ["model.model.embed_tokens.weight", "model.model.norm.weight"]
    assert first["remote"] == ["model.model.norm.weight"] and last["remote"] == []


def test_untied_embedding_and_head_are_each_on_one_stage():
    first, middle, _, last = run_distributed(_placement, 4, False)
    assert first["tags"] == {"model.model.embed_tokens.weight": "local"}
    assert last["tags"] == {"model.model.norm.weight": "local", "model.lm_head.weight": "local"}
    assert middle["tags"] == {}
    assert last["parts"]["model.embed_tokens"] == SkippedEmbedding.__name__
    assert first["remote"] == ["model.lm_head.weight", "model.model.norm.weight"]
    assert last["remote"] == ["model.model.embed_tokens.weight"]


def test_under_tensor_parallelism_too_each_part_is_on_its_stage_only():
    # The rewrite replaces the embedding and head by vocabulary-parallel ones; the placement is read before it.
    first, _, last, _ = run_distributed(_placement, 4, False, 2)  # pp 2 x tp 2: ranks 0, 1 first stage; 2, 3 last
    skipped, last_only = SkippedEmbedding.__name__, LastStageOnly.__name__
    assert first["parts"] == {"model.embed_tokens": "VocabParallelEmbedding", "model.norm": last_only,
                              "lm_head": last_only}
    assert last["parts"]["model.embed_tokens"] == skipped and last["parts"]["model.norm"] == "LlamaRMSNorm"
    assert first["tags"] == {"model.model.embed_tokens.weight": "local"}
    assert last["tags"] == {"model.model.norm.weight": "local", "model.lm_head.weight": "local"}
