"""What LoRA costs under the strategy, counted exactly: the tensor-parallel traffic is the frozen base's plus r-sized
adapter terms (one all-gather forward and one reduce-scatter backward of ``[s, b, r]`` per column-parallel adapter
under SP; one all-reduce backward without SP; nothing for a row-parallel adapter, whose partial product joins the
base's reduction); frozen parameters get no gradient bucket, no optimizer state and no data-parallel traffic."""

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import Layout, SeqParallelStrategy
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, SEQ, build, loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

R, LAYERS, COLUMN_ADAPTERS = 2, 2, 5  # q, k, v, gate, up per layer


def _records(lora, sp):
    module = build("hf", labels=True, lora=lora).double()
    group = ParallelGroup(torch.distributed.group.WORLD)
    rewrite(module, RewriteContext(group, sp))
    x, y = token_data(1, 1).tensors
    group.log = CommunicationLog()
    loss = module.compute_loss(x[:BATCH], y[:BATCH])
    forward = Counter((r.kind, r.full_bytes) for r in group.log.records)
    group.log.clear()
    loss.backward()
    return forward, Counter((r.kind, r.full_bytes) for r in group.log.records)


def _traffic(rank, world_size):
    return {sp: {lora: _records(lora, sp) for lora in ("all", "rows")} for sp in (True, False)}


@pytest.fixture(scope="module")
def traffic():
    return run_distributed(_traffic, 2)[0]


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
def test_tensor_parallel_traffic_is_the_bases_plus_r_sized_adapter_terms(traffic, sp):
    adapter = SEQ * BATCH * R * 8  # [s, b, r] float64
    (fwd_all, bwd_all), (fwd_rows, bwd_rows) = traffic[sp]["all"], traffic[sp]["rows"]
    n = LAYERS * COLUMN_ADAPTERS
    if sp:
        assert fwd_all - fwd_rows == Counter({("all_gather", adapter): n}) and not fwd_rows - fwd_all
        assert bwd_all - bwd_rows == Counter({("reduce_scatter", adapter): n}) and not bwd_rows - bwd_all
    else:
        assert fwd_all == fwd_rows
        assert bwd_all - bwd_rows == Counter({("all_reduce", adapter): n}) and not bwd_rows - bwd_all


class _Held(pl.Callback):
    """After one step: what the buckets, the optimizer and the data-parallel group saw."""

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.mesh.data.log = CommunicationLog()

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "inner", optimizer)  # the distributed optimizer's wrapped optimizer
        names = {id(p): n for n, p in pl_module.named_parameters()}
        buckets = getattr(optimizer, "buckets", None) or trainer.strategy.grad_sync.buckets
        self.trainable = sorted(n for n, p in pl_module.named_parameters() if p.requires_grad)
        self.padded_numel = sum(-(-p.numel() // 2) * 2 for p in pl_module.parameters() if p.requires_grad)  # d = 2
        self.bucketed = sorted(names[id(p)] for bucket in buckets.buckets for p in bucket.params)
        self.optimized = len([p for group in inner.param_groups for p in group["params"]])
        self.states = len(inner.state)
        self.grads = sorted(n for n, p in pl_module.named_parameters() if p.grad is not None)
        log = trainer.strategy.mesh.data.log
        self.data = {kind: sum(r.full_bytes for r in log.records if r.kind == kind)
                     for kind in ("all_reduce", "reduce_scatter", "all_gather")}


def _frozen(rank, world_size):
    out = {}
    for zero in (0, 1):
        held = _Held()
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=1, logger=False,
                             strategy=SeqParallelStrategy(tp=2, layout=Layout(zero=zero)),
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, callbacks=[held])
        trainer.fit(build("hf", labels=True, lora="all"), loader(token_data(1, 2)))
        out[zero] = held
    return out


@pytest.fixture(scope="module")
def frozen():
    return run_distributed(_frozen, 4)[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_frozen_parameters_have_no_bucket_no_state_and_no_data_parallel_traffic(frozen, zero):
    held = frozen[zero]
    assert len(held.trainable) == 2 * 7 * 2 and all(".lora_" in n for n in held.trainable)
    assert held.bucketed == held.trainable  # the buckets hold the adapters, nothing of the frozen base
    assert held.states == len(held.trainable)  # optimizer state for the adapters (zero 1: their ranges) only
    if zero == 1:  # the distributed optimizer's inner optimizer is given the adapters' ranges alone
        assert held.optimized == len(held.trainable)
    assert set(held.grads) <= set(held.trainable)
    # Frozen parameters move nothing over the data-parallel group: the gradients reduced are the adapters' (this
    # rank's tensor-parallel shards, float64; zero 1 pads each to a multiple of d = 2 and gathers the updated ranges).
    adapters = held.padded_numel * 8
    want = {"all_reduce": adapters, "reduce_scatter": 0, "all_gather": 0} if zero == 0 else \
        {"all_reduce": 0, "reduce_scatter": adapters, "all_gather": adapters}
    assert held.data == want


def _saved_by_adapters(rank, world_size):
    """Shapes and storages of what LoRA-A of column-parallel layers keeps for backward, and of the base's input."""
    from lightning_seqpar.transformer.lora import LoRAColumnParallelLinear

    module = build("hf", labels=True, lora="all").double()
    group = ParallelGroup(torch.distributed.group.WORLD)
    rewrite(module, RewriteContext(group, True))
    kept = []
    original = LoRAColumnParallelLinear.adapter

    def adapter(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            return original(self, x)

    LoRAColumnParallelLinear.adapter = adapter
    try:
        x, y = token_data(1, 1).tensors
        module.compute_loss(x[:BATCH], y[:BATCH])
    finally:
        LoRAColumnParallelLinear.adapter = original
    return [(tuple(t.shape), t.untyped_storage().data_ptr()) for t in kept]


def test_lora_a_keeps_only_the_sequence_local_input_under_sp():
    kept = run_distributed(_saved_by_adapters, 2)[0]  # matmuls keep their inputs flattened: [tokens, features]
    h, t = 16, 2
    inputs = [(shape, ptr) for shape, ptr in kept if shape[-1] == h and shape != (R, h)]  # not A itself
    assert inputs and all(shape == (SEQ // t * BATCH, h) for shape, _ in inputs)  # s/t·b tokens: ÷ t, never gathered
    gathered = [shape for shape, _ in kept if shape[-1] == R and shape[0] > R]
    assert gathered and all(shape == (SEQ * BATCH, R) for shape in gathered)  # what is gathered is r-sized
    # Per layer two inputs (q/k/v's and gate/up's: the norm outputs the base keeps for its own backward), no copy.
    assert len({ptr for _, ptr in inputs}) == 2 * 2
