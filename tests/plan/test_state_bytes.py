"""The planner's model-state bytes equal what each rank of the strategy holds after a training step: parameters,
gradients (with their reduction buckets), main params and optimizer state, per pipeline and data-parallel rank, over
layouts with vocabulary padding, tied and untied embeddings, uneven and interleaved pipeline stages, zero 0 and 1,
every precision, the Llama, GPT-2 and Phi-3 (fused, unequal q/k/v) layouts, and mixtures of experts (Qwen3-MoE,
gpt-oss, Qwen2-MoE, GLM-4.5) at ep 1, 2 and 4, where expert parallelism and tensor parallelism differ, and with each
expert's width split over expert_tp 2; Muon under zero 0 and 1."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_seqpar import Layout, SeqParallelStrategy
from lightning_seqpar.plan.measuring.models import inventory_of_hf_model
from lightning_seqpar.plan.pricing.state import state_bytes
from tests.helpers.distributed import run_distributed
from lightning_seqpar.lightning.callbacks import model_state
from tests.helpers.models import build, loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

# (model options, tp, pp, zero, precision, fp32 main params, strategy extras): world 4, dp = 4 / (tp·pp)
LAYOUTS = [
    (dict(tie=True), 2, 2, 0, "32-true", False, {}),                      # vocabulary 13 padded to 14, tied over stages
    (dict(), 2, 1, 0, "bf16-true", False, {}),                            # dp 2: 16-bit .grad beside float32 buckets
    (dict(), 2, 1, 1, "32-true", False, {}),                              # zero 1: reduce-scatter buckets, ranges
    (dict(tie=True), 1, 2, 1, "bf16-true", True, {}),                     # float32 main params of the ranges
    (dict(tie=True), 1, 1, 0, "bf16-mixed", False, {}),                   # dp 4: float32 parameters, all-reduce
    (dict(kv_heads=4), 4, 1, 0, "32-true", False, {}),                    # vocabulary 13 padded to 16
    (dict(layers=4), 1, 2, 1, "32-true", False, dict(pipeline_split=(1, 3))),  # uneven stages, uneven ranges
    (dict(layers=4, tie=True), 2, 2, 0, "32-true", False,
     dict(virtual_stages=2, schedule="interleaved_1F1B", num_microbatches=2)),  # interleaved: two chunks per rank
    (dict(family="gpt2"), 2, 2, 0, "32-true", False, {}),                 # Conv1D, biases, learned positions
    (dict(family="phi3"), 2, 1, 1, "bf16-true", True, {}),                # fused q/k/v of unequal sizes
    (dict(lora="all"), 2, 1, 0, "bf16-true", False, {}),                  # LoRA: a frozen base costs its 2 bytes only
    (dict(lora="all", tie=True), 2, 2, 1, "32-true", False, {}),          # adapters' ranges, frozen embedding on 2 stages
    (dict(lora="attention"), 1, 2, 1, "bf16-true", True, {}),             # main params of the adapters only
    # Mixtures of experts (experts whole on each rank, split over ep; their replicas edp = t·d / e)
    (dict(family="qwen3_moe"), 2, 1, 0, "32-true", False, dict(ep=2)),    # edp 2: all-reduce buckets
    (dict(family="qwen3_moe"), 2, 1, 1, "32-true", False, dict(ep=1)),    # edp 4: expert ranges over tp peers too
    (dict(family="qwen3_moe"), 2, 2, 0, "bf16-true", False, dict(ep=1)),  # d 1 but edp 2: buckets all the same
    (dict(family="qwen3_moe"), 1, 1, 1, "bf16-true", True, dict(ep=4)),   # edp 1: whole expert ranges
    (dict(family="gpt_oss"), 2, 1, 1, "bf16-mixed", False, dict(ep=2)),   # expert biases, router bias, sinks
    (dict(family="qwen2_moe"), 2, 1, 0, "bf16-true", False, dict(ep=2)),  # a column/row-parallel shared expert
    (dict(family="glm4_moe"), 1, 2, 1, "32-true", False, dict(ep=2)),  # a dense first layer
    # Expert tensor parallelism: each expert's width split too, numel / (e·etp); edp = t·d / (e·etp)
    (dict(family="qwen3_moe"), 2, 1, 0, "32-true", False, dict(ep=2, expert_tp=2)),   # edp 1: no expert buckets
    (dict(family="gpt_oss"), 2, 1, 0, "bf16-true", False, dict(expert_tp=2)),  # the down bias whole, edp 2
    # Muon (optim.name=muon): momentum on the layers' matrices, AdamW's states and step on the rest
    (dict(optimizer="muon"), 2, 1, 0, "32-true", False, {}),
    (dict(optimizer="muon", tie=True), 1, 2, 1, "bf16-true", True, {}),   # its ranges' float32 state
    (dict(family="qwen3_moe", optimizer="muon"), 2, 1, 1, "32-true", False, dict(ep=2)),  # experts' ranges over edp
]


def _bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        if t is not None and t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class _Held(pl.Callback):
    """What this rank holds after its step, by kind (bytes of distinct storages)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mesh = trainer.strategy.mesh
        held = {kind: _bytes(tensors) for kind, tensors in model_state(trainer, pl_module).items()}
        self.held = dict(coordinates=(mesh.pipeline.rank, mesh.data.rank, mesh.group("edp").rank), **held)


def _measure(rank, world):
    out = []
    for options, tp, pp, zero, precision, main, extra in LAYOUTS:
        held = _Held()
        layout = Layout(tp=tp, pp=pp, zero=zero, fp32_main_params=main, **extra)
        trainer = pl.Trainer(accelerator="cpu", devices=world, precision=precision, max_steps=1, logger=False,
                             strategy=SeqParallelStrategy(layout=layout),
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, callbacks=[held])
        trainer.fit(build("hf", labels=True, **options), loader(token_data(1, world // (tp * pp))))
        out.append(held.held)
    return out


@pytest.fixture(scope="module")
def held():
    return run_distributed(_measure, 4)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=lambda i: str(LAYOUTS[i][:6]))
def test_predicted_model_state_bytes_equal_what_each_rank_holds(held, index):
    options, tp, pp, zero, precision, main, extra = LAYOUTS[index]
    inventory = inventory_of_hf_model(build("hf", **{k: v for k, v in options.items() if k != "optimizer"}).model)
    for rank in held:
        got = rank[index]
        pipeline_rank, data_rank, expert_data_rank = got["coordinates"]
        want = state_bytes(inventory, tp, pp, 4 // (tp * pp), pipeline_rank=pipeline_rank, data_rank=data_rank,
                           vpp=extra.get("virtual_stages", 1), zero=zero, precision=precision, main_params=main,
                           pipeline_split=extra.get("pipeline_split"), ep=extra.get("ep", 1),
                           expert_data_rank=expert_data_rank, expert_tp=extra.get("expert_tp", 1),
                           optimizer=options.get("optimizer", "adamw"))
        assert {k: got[k] for k in ("parameters", "gradients", "main_params", "optimizer")} == {
            "parameters": want.parameters, "gradients": want.gradients, "main_params": want.main_params,
            "optimizer": want.optimizer}, (pipeline_rank, data_rank)
