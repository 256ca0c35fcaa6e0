"""Per pipeline rank, the memory model holds to the byte: stage 0 of a pp 2 reference GPT (1F1B, m 4, float64, dropout
0.1) holds, after every action of its schedule, exactly ``in flight × layers × the model's per-layer bytes`` (beside
the cached causal mask), with recomputation by module and activation offload as with neither — and, with the layers'
inputs offloaded, the stage's output (kept for its backward) beside them, as :func:`~lightning_seqpar.offload.plan.
plan_offload` counts it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_seqpar import ActivationOffload, SelectiveRecompute, SeqParallelStrategy
from lightning_seqpar.memory.activations import TransformerShape, layer_activation_terms
from lightning_seqpar.memory.tracker import LiveActivationTracker
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, build, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed

M, P = 4, 2
LAYERS = "gpt.transformer.h"
CHOICES = [  # (recompute, by module, offloaded)
    ("none", (), ()),
    ("none", (), ("attn_norm", "mlp")),
    ("none", ("layernorm", "mlp"), ("core_attn",)),
    ("selective", ("layernorm",), ("attn_proj", "mlp")),
]


class _Measure(pl.Callback):
    """Live bytes of the layer stack's forward storages after each schedule action (one step)."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracker = LiveActivationTracker(pl_module).__enter__()
        trainer.strategy.pipeline.executor.observers.append(lambda action, in_flight: self.samples.append(
            (repr(action), in_flight, self.tracker.live_bytes(LAYERS))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tracker.__exit__(None, None, None)
        trainer.strategy.pipeline.executor.observers.clear()


def _callbacks(recompute, modules, offload) -> list:
    names = [*modules, *(["core_attn"] if recompute == "selective" else [])]
    return [*([SelectiveRecompute(modules=names)] if names else []),
            *([ActivationOffload(modules=list(offload))] if offload else [])]


def _measure(rank, world_size):
    out = []
    for choice in CHOICES:
        measure = _Measure()
        trainer = pl.Trainer(strategy=strategy_of(pp=P, num_microbatches=M), accelerator="cpu",
                             devices=world_size, precision="64-true", max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, callbacks=[measure, *_callbacks(*choice)])
        trainer.fit(build("gpt", dropout=0.1), DataLoader(token_data(M // 2, 1), batch_size=M))
        out.append(measure.samples)
    return out


@pytest.fixture(scope="module")
def samples():
    return run_distributed(_measure, P)


@pytest.mark.parametrize("index", range(len(CHOICES)),
                         ids=[f"{r}+{'+'.join(m) or '-'}|{'+'.join(o) or '-'}" for r, m, o in CHOICES])
def test_stage_0_holds_in_flight_times_the_model_s_layer_bytes_after_every_action(samples, index):
    recompute, modules, offload = CHOICES[index]
    stage0 = samples[0][index]
    assert len(stage0) == 2 * M
    cached = stage0[-1][2]  # alive after the last backward: the causal mask
    # one layer per stage (2 layers over pp 2), micro-batches of one sequence, float64 activations and norm statistics
    shape = TransformerShape(s=SEQ, b=1, h=16, a=4)
    one = sum(layer_activation_terms(shape, recompute=recompute, bytes_per_element=8, modules=modules,
                                     offload=offload, norm_statistics_bytes=8).values())
    # the stage's output stays for its micro-batch's backward: with the layers' inputs offloaded, it is not the next
    # layer's offloaded input on this rank (the next stage offloads its own copy)
    one += 8 * SEQ * 16 if "attn_norm" in offload else 0
    for action, in_flight, live in stage0:
        assert live == cached + in_flight * one, (action, in_flight, live, one)
    assert max(n for _, n, _ in stage0) == P
