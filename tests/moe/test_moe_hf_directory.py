"""A Hugging Face mixture-of-experts directory as transformers writes it (one tensor per expert and part:
``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``) is read straight into each
rank's experts (only its own experts' tensors), gives the one-device logits, and is exported back under the hub's
per-expert names (and the family's renamings reversed: Mixtral's ``block_sparse_moe``, GraniteMoE's ``input_linear``),
the names ``save_pretrained`` gives; gpt-oss's packed experts (gate and up interleaved, with biases) and attention sinks
as they are; ``from_pretrained`` reloads the export with the same weights. Experts frozen in the user's model
stay frozen in the shards. Layouts: tp 2 × ep 2 (the experts over
the tensor-parallel ranks), ep 2 over two data-parallel replicas, and each expert's width split over expert_tp 2 (every
rank holding every expert's half: read, gathered for the export, the halves of gate/up or gpt-oss's interleave kept)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models import HFCausalLMModule
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.models import token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "granitemoe")
PACKED = {"gpt_oss": "model.layers.0.mlp.experts.gate_up_proj_bias",
          "granitemoe": "model.layers.0.block_sparse_moe.input_linear.weight"}
"""Families whose hub checkpoints keep the experts packed, and a key they store: gpt-oss ``[E, h, 2f]`` (gate and up
interleaved) with biases; GraniteMoE ``[E, 2f, h]`` under its own names (``input_linear``, ``router.layer``)."""
LAYOUTS = {"tp2-ep2": dict(tp=2, ep=2), "dp2-ep2": dict(tp=1, ep=2), "tp2-etp2": dict(tp=2, expert_tp=2)}


def _stored_keys(directory):
    from safetensors import safe_open

    keys = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys.update(f.keys())
    return keys


class FrozenExperts(HFCausalLMModule):
    """The experts frozen, as a fine-tuning run that adapts other parts leaves them."""

    def configure_model(self):
        super().configure_model()
        for name, param in self.named_parameters():
            if ".experts." in name:
                param.requires_grad_(False)


def _read_and_export(rank, world, root):
    out = {}
    x = token_data(1, 1, seed=3).tensors[0]
    for family in FAMILIES:
        for name, layout in LAYOUTS.items():
            module = FrozenExperts(pretrained=f"{root}/{family}")
            trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy_of(**layout),
                                 precision="64-true", logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False)
            trainer.validate(module, DataLoader([(x[0], x[0])], batch_size=1), verbose=False)
            module.eval()
            with torch.no_grad():
                out[family, name] = module.model(input_ids=x).logits
            out[family, name, "trainable experts"] = [n for n, p in module.named_parameters()
                                                      if ".experts." in n and p.requires_grad]
            trainer.strategy.save_hf_pretrained(f"{root}/{family}-{name}-export")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_directories")
    for family in FAMILIES:
        torch.manual_seed(0)
        model = HFCausalLM(family=family).model.double()
        with torch.no_grad():
            for param in model.parameters():  # not the seeded init: every expert differs visibly
                param.normal_(0, 0.3)
        model.save_pretrained(root / family)
    return root, run_distributed(_read_and_export, 2, str(root))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_per_expert_directory_reads_into_the_shards_and_exports_back_under_the_hub_names(exported, family, layout):
    from transformers import AutoModelForCausalLM

    root, per_rank = exported
    stored = _stored_keys(root / family)
    if family in PACKED:
        assert PACKED[family] in stored
    else:  # the hub's layout: one tensor per expert
        assert any(".experts.3." in key for key in stored)
    source = AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float64, experts_implementation="eager")
    x = token_data(1, 1, seed=3).tensors[0]
    with torch.no_grad():
        want = source(input_ids=x).logits
    for rank_out in per_rank:  # RMSNorm and the router's softmax compute in float32 (a wrong expert: O(1) apart)
        torch.testing.assert_close(rank_out[family, layout], want, rtol=1e-6, atol=1e-6)
        assert rank_out[family, layout, "trainable experts"] == []  # frozen before the rewrite, frozen after it
    export = root / f"{family}-{layout}-export"
    assert _stored_keys(export) == stored  # the names save_pretrained gives: per expert, renamed as the hub's
    reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64, experts_implementation="eager")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert json.loads((export / "config.json").read_text())["model_type"] == family
