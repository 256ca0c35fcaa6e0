"""LoRA trained at tp 2 × pp 2 (SP) goes back to the ecosystem: a PEFT adapter directory that
``PeftModel.from_pretrained(base, DIR)`` loads bit-identically to what was trained, giving the trained model's logits
(one process's training as the reference); and a merged Hugging Face directory (W + (α/r)·B·A) whose logits equal
the unmerged model's."""

import json

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_state_dict
from lightning_seqpar.checkpoint.peft_export import export_peft_adapter
from lightning_seqpar.checkpoint.stages import merge_over_stages
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, build, loader, reference_run, token_data
from tests.helpers.parity import STEPS

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(labels=True, lora="all")


class _Export(pl.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        export_peft_adapter(pl_module, strategy.mesh, self.out / "adapter")
        strategy.save_hf_pretrained(self.out / "merged", merge_lora=True)
        state = merge_over_stages(full_state_dict(pl_module, strategy.mesh.tensor), strategy.mesh.pipeline)
        self.adapters = {k: v for k, v in state.items() if ".lora_" in k}


def _train(rank, world_size, out):
    export = _Export(out)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=STEPS, logger=False,
                         strategy=SeqParallelStrategy(tp=2, pp=2), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[export])
    trainer.fit(build("hf", **MODEL), loader(token_data(STEPS, 1)))
    return export.adapters


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_export")
    return out, run_distributed(_train, 4, out)[0]


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_the_adapter_directory_loads_in_peft_as_trained(exported):
    from peft import PeftModel
    from safetensors.torch import load_file

    out, trained = exported
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4
    stored = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert len(stored) == 2 * 7 * 2 and all(k.startswith("base_model.model.model.layers.") for k in stored)
    base = build("hf", labels=True).model.double()  # the same frozen base (same seed), without adapters
    loaded = PeftModel.from_pretrained(base, str(out / "adapter"))
    for key, value in stored.items():  # bit-identical to the tp 2 × pp 2 shards gathered
        parts = key.split(".")
        live = loaded.get_submodule(".".join(parts[:-1]) + ".default").weight
        assert torch.equal(live, value) and torch.equal(value, trained["model." + key.replace(".weight",
                                                                                              ".default.weight")])
    reference = build("hf", **MODEL)
    ref = reference_run(reference, token_data(STEPS, 1), STEPS, 1)
    reference = reference.double()
    reference.load_state_dict(ref.final_state)
    x = token_data(1, 1).tensors[0][:BATCH]
    got, want = _logits(loaded, x), _logits(reference.model, x)
    # Trained in float64 where Hugging Face's norms and loss run in float32 (tests/transformer/test_lora_parity.py): the
    # two trainings agree to float32 rounding, compounded over the steps (1.4e-6 with transformers 5.24 / peft 0.21.2,
    # where the bound was 1e-6); an adapter lost or mis-sliced changes the logits by orders more.
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_the_merged_directory_computes_the_adapted_model(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, _ = exported
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float64)
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    adapted = PeftModel.from_pretrained(build("hf", labels=True).model.double(), str(out / "adapter"))
    x = token_data(1, 1).tensors[0][:BATCH]
    got, want = _logits(merged, x), _logits(adapted, x)
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # float32 norms inside, as above
    unmerged_base = _logits(build("hf", labels=True).model.double(), x)
    assert ((unmerged_base - want).norm() / want.norm()).item() > 1e-3  # the adapters do change the model
