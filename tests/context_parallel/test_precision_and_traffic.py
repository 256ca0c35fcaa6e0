"""Context parallelism under bf16-mixed, bf16-true and 32-true: the bytes a rank sends per step for attention equal
:func:`bytes_per_layer` at the dtype attention computes in (16-bit under autocast, where rotary embeddings hand over
float32 q and k: the ring would otherwise move twice the bytes), and training follows one process within the
precision's tolerance."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.context_parallel.attention import bytes_per_layer
from lightning_seqpar.parallel import CommunicationLog
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, SEQ, build, loader, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 4  # tests.helpers.hf_models' tiny Llama


class _Traffic(pl.Callback):
    def __init__(self) -> None:
        self.bytes: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.mesh.context.log = CommunicationLog()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log = trainer.strategy.mesh.context.log
        self.bytes.append({kind: log.bytes_moved(kind) for kind in ("ring_send", "all_to_all")})


def _train(rank, world_size, precision, comm):
    traffic = _Traffic()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision=precision, max_steps=2, logger=False,
                         strategy=strategy_of(cp=world_size, cp_comm=comm), callbacks=[traffic],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    torch.manual_seed(0)
    trainer.fit(build("hf", labels=True, kv_heads=KV_HEADS if comm == "ring" else HEADS), loader(token_data(2, 1)))
    return traffic.bytes, trainer.callback_metrics["train/loss"].item()


@pytest.mark.parametrize("precision,element_size", [("bf16-mixed", 2), ("bf16-true", 2), ("32-true", 4)])
@pytest.mark.parametrize("comm", ["ring", "all_to_all"])
def test_attention_traffic_is_in_the_dtype_attention_computes_in(precision, element_size, comm):
    per_rank = run_distributed(_train, 2, precision, comm)
    kv_heads = KV_HEADS if comm == "ring" else HEADS
    formula = bytes_per_layer(comm, BATCH, SEQ, HEADS, kv_heads, HEAD_DIM, 1, 2, element_size)
    kind = "ring_send" if comm == "ring" else "all_to_all"
    per_step = LAYERS * (formula["forward"][kind] + formula["backward"][kind])
    for steps, loss in per_rank:
        assert [step[kind] for step in steps] == [per_step, per_step]
        assert torch.isfinite(torch.tensor(loss))
    assert per_rank[0][1] == per_rank[1][1]  # both cp ranks hold the whole sequence's loss
