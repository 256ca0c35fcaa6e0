"""Adapters on a mixture's experts as users keep and share them: checkpoints reshard them with their experts (saved at
tp 2 × ep 2, resumed with each expert's width split too, then into one full-format file at ep 1 × expert_tp 2, then
over ep 4, then with the optimizer state split over data-parallel ranks (zero 1), then into a pipeline of 2 stages at
ep 2) on the loss curve of the uninterrupted one-process run; and, trained at ep 2 × expert_tp 2 (tp 2, dp 2), they
export as a PEFT adapter directory that ``PeftModel.from_pretrained`` loads bit for bit as trained, with the
one-process training's logits, and as a merged Hugging Face directory (``W_i + (α/r)·B_i·A_i`` per expert, written as
the hub's per-expert tensors) with the adapted model's logits."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar.checkpoint.full_state import full_state_dict
from lightning_seqpar.checkpoint.peft_export import export_peft_adapter
from lightning_seqpar.checkpoint.stages import merge_over_stages
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, build, loader, reference_run, token_data
from tests.helpers.parity import STEPS
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(family="qwen3_moe", labels=True, lora="experts")
LAYOUTS = (dict(tp=2, ep=2), dict(tp=2, ep=2, expert_tp=2), dict(tp=2, ep=1, expert_tp=2, checkpoint_format="full"),
           dict(tp=1, ep=4), dict(tp=2, ep=2, zero=1), dict(tp=1, pp=2, ep=2))


def _lives(rank, world, root):
    losses = []
    for epoch, layout in enumerate(LAYOUTS):
        losses += train_epochs(rank, world, strategy_of(**layout), build("hf", **MODEL), epoch + 1,
                               f"{root}/epoch{epoch}", f"{root}/epoch{epoch - 1}/last.ckpt" if epoch else None)
    return losses


def test_expert_adapters_reshard_across_ep_expert_tp_formats_and_pp_on_the_one_process_curve(tmp_path):
    want = reference_epochs(build("hf", **MODEL).double(), len(LAYOUTS))
    got = run_distributed(_lives, 4, str(tmp_path))[0]
    assert len(got) == len(want) == EPOCH_STEPS * len(LAYOUTS)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


class _Export(pl.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        export_peft_adapter(pl_module, strategy.mesh, self.out / "adapter")
        strategy.save_hf_pretrained(self.out / "merged", merge_lora=True)
        state = merge_over_stages(full_state_dict(pl_module, strategy.mesh), strategy.mesh.pipeline)
        self.adapters = {k: v for k, v in state.items() if ".lora_" in k}


def _train(rank, world_size, out):
    export = _Export(out)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=STEPS, logger=False,
                         strategy=strategy_of(tp=2, ep=2, expert_tp=2), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[export])
    trainer.fit(build("hf", **MODEL), loader(token_data(STEPS, 2), BATCH))
    return export.adapters


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_lora_export")
    return out, run_distributed(_train, 4, out)[0]


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_the_expert_adapters_load_in_peft_as_trained(exported):
    from peft import PeftModel
    from safetensors.torch import load_file

    out, trained = exported
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    stored = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert sum(".mlp.experts." in k for k in stored) == 2 * 2 * 2  # A and B of both projections, 2 layers
    assert stored["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"].shape == (16, 16)  # 2f, r·E
    base = build("hf", family="qwen3_moe", labels=True).model.double()
    loaded = PeftModel.from_pretrained(base, str(out / "adapter"))
    for key, value in stored.items():  # bit-identical to the ep 2 × expert_tp 2 shards gathered
        parts = key.split(".")
        live = loaded.get_submodule(".".join(parts[:-1]) + ".default").weight
        assert torch.equal(live, value) and torch.equal(value, trained["model." + key.replace(".weight",
                                                                                              ".default.weight")])
    reference = build("hf", **MODEL)
    ref = reference_run(reference, token_data(STEPS, 2), STEPS, 2)
    reference = reference.double()
    reference.load_state_dict(ref.final_state)
    x = token_data(1, 1).tensors[0][:BATCH]
    got, want = _logits(loaded, x), _logits(reference.model, x)
    # float32 norms inside a float64 training, as tests/checkpoint/test_lora_export.py says
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_the_merged_directory_computes_the_model_with_its_expert_adapters(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, _ = exported
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float64,
                                                  experts_implementation="eager")
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    adapted = PeftModel.from_pretrained(build("hf", family="qwen3_moe", labels=True).model.double(),
                                        str(out / "adapter"))
    x = token_data(1, 1).tensors[0][:BATCH]
    got, want = _logits(merged, x), _logits(adapted, x)
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    experts_only = PeftModel.from_pretrained(build("hf", family="qwen3_moe", labels=True).model.double(),
                                             str(out / "adapter"))
    for name, module in experts_only.named_modules():  # the attention's adapters off: the experts' alone must differ
        if name.endswith(("q_proj", "v_proj")) and hasattr(module, "scaling"):
            module.scaling["default"] = 0.0
    base = _logits(build("hf", family="qwen3_moe", labels=True).model.double(), x)
    assert ((_logits(experts_only, x) - base).norm() / base.norm()).item() > 1e-3  # the expert adapters do change it
