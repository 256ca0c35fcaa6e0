"""ZeRO-1 with Megatron-LM's traffic (tp 2 x dp 2): trains exactly as zero=0 does, each data-parallel rank holds the
state of its element range of every parameter, and reduce-scatter + all-gather move what zero=0's all-reduce moves.
Parity with one process (clipping, accumulation, pipelines): test_parity / test_pipeline_parity; checkpoints across
zero settings: test_sharded_checkpoint."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.optim import DistributedOptimizer
from lightning_seqpar.optim.distributed_optimizer import optimizer_state_bytes
from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.parallel import CommunicationLog
from lightning_seqpar.parallel.placement import is_sequence_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, loader, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

WIDE = (("n_embd", 64), ("n_layer", 2))
PRECISIONS = ("64-true", "bf16-mixed", "bf16-true")
DP = 2


class _LogData(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.log = trainer.strategy.mesh.data.log = CommunicationLog()


def _fit(world_size, zero, precision="64-true", steps=2):
    logger = _LogData()
    trainer = pl.Trainer(strategy=strategy_of(tp=2, zero=zero), accelerator="cpu", devices=world_size,
                         precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[logger])
    trainer.fit(build("gpt", **dict(WIDE)), loader(token_data(2, 2)))
    optimizer = trainer.strategy.optimizers[0]
    params = [p for p in trainer.lightning_module.parameters() if p.requires_grad]
    rank = trainer.strategy.mesh.data.rank
    return {
        "state_bytes": optimizer_state_bytes(optimizer),
        "distributed": isinstance(optimizer, DistributedOptimizer),
        # AdamW: exp_avg and exp_avg_sq over this rank's range of each parameter, and a float32 step per parameter
        "expected_zero1_bytes": sum(2 * (lambda r: r[1] - r[0])(owned_range(p.numel(), DP, rank)) * p.element_size()
                                    + 4 for p in params),
        "numels": [(p.numel(), p.element_size()) for p in params],
        "sequence_parallel": {n for n, p in trainer.lightning_module.named_parameters() if is_sequence_parallel(p)},
        "collectives": [(r.kind, r.full_bytes, r.group_size) for r in logger.log.records],
        "bytes": {kind: logger.log.bytes_moved(kind) for kind in ("all_reduce", "reduce_scatter", "all_gather")},
        "state": trainer.strategy.full_state_dict(),
    }


def _both(rank, world_size):
    runs = {precision: (_fit(world_size, 0, precision), _fit(world_size, 1, precision)) for precision in PRECISIONS}
    runs["bf16-true one step"] = (_fit(world_size, 0, "bf16-true", 1), _fit(world_size, 1, "bf16-true", 1))
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both, 4)  # tp 2 x dp 2


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
def test_zero1_trains_exactly_like_replicated_optimizer_state(runs, precision):
    for per_precision in runs:
        replicated, sharded = per_precision[precision]
        assert sharded["distributed"] and not replicated["distributed"]
        assert replicated["state"].keys() == sharded["state"].keys()
        for key in replicated["state"]:  # the same update of each element, computed by its owner: bit for bit
            torch.testing.assert_close(sharded["state"][key], replicated["state"][key], rtol=0, atol=0, msg=key)


def test_zero1_bf16_true_rounds_only_the_sequence_parallel_sums_differently(runs):
    # zero=0 rounds the averaged 16-bit gradient to bfloat16 before summing sequence-parallel gradients over tp;
    # zero=1 sums the float32 average and rounds once. Every other parameter's first update is bit for bit the same.
    for per_precision in runs:
        replicated, sharded = per_precision["bf16-true one step"]
        for key, want in replicated["state"].items():
            got = sharded["state"][key]
            if key in replicated["sequence_parallel"]:
                # AdamW's first update is ±lr per element (lr = 1e-2): a near-zero gradient may round to either sign
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 * 1e-2 + 1e-3, msg=key)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)


def test_zero1_optimizer_state_is_an_element_range_of_each_parameter(runs):
    tp = 2
    for tp_rank in range(tp):
        ranks = [runs[tp_rank + tp * d]["64-true"] for d in range(DP)]  # same shards, different data-parallel ranks
        full = ranks[0][0]["state_bytes"]
        assert all(r[0]["state_bytes"] == full for r in ranks)  # zero=0: every replica holds all of it
        parts = [r[1]["state_bytes"] for r in ranks]
        assert parts == [r[1]["expected_zero1_bytes"] for r in ranks]  # exactly its ranges
        steps = 4 * len(ranks[0][1]["numels"])
        assert sum(parts) == full + (DP - 1) * steps  # every element's state on one rank (the step on each)
        assert max(parts) <= (full - steps) / DP + steps + 2 * 8 * len(ranks[0][1]["numels"])  # 1/d, to an element


def test_zero1_moves_what_one_all_reduce_of_the_gradients_moves(runs):
    for per_precision in runs:
        for precision in PRECISIONS:
            replicated, sharded = per_precision[precision]
            numels = sharded["numels"]
            assert all(n % DP == 0 for n, _ in numels)  # no padding in this model: the totals are equal exactly
            assert {kind for kind, _, _ in replicated["collectives"]} == {"all_reduce"}
            assert {kind for kind, _, _ in sharded["collectives"]} == {"reduce_scatter", "all_gather"}
            steps = 2
            gradient_bytes = sum(n * max(4, size) for n, size in numels)  # 16-bit gradients reduced in float32
            parameter_bytes = sum(n * size for n, size in numels)
            assert replicated["bytes"]["all_reduce"] == steps * 2 * (DP - 1) * gradient_bytes // DP
            assert sharded["bytes"]["reduce_scatter"] == steps * (DP - 1) * gradient_bytes // DP
            assert sharded["bytes"]["all_gather"] == steps * (DP - 1) * parameter_bytes // DP
            if precision != "bf16-true":  # float32/float64 parameters: one all-reduce's bytes exactly
                assert sum(sharded["bytes"].values()) == replicated["bytes"]["all_reduce"]
            else:  # 16-bit parameters are gathered as they are: a quarter less
                assert sum(sharded["bytes"].values()) == replicated["bytes"]["all_reduce"] * 3 // 4


def _epochs(world_size, epochs, directory=None, resume=None, zero=1, main=True):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)] if directory else []
    trainer = pl.Trainer(strategy=strategy_of(tp=2, zero=zero, fp32_main_params=main), accelerator="cpu",
                         devices=world_size, precision="bf16-true", max_epochs=epochs, logger=False,
                         enable_checkpointing=bool(directory), enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=callbacks, use_distributed_sampler=False)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    trainer.fit(build("gpt", **dict(WIDE)), loader(token_data(2, 1, seed=(rank // 2) % DP)), ckpt_path=resume)
    return trainer.strategy.full_state_dict()


def _resumes(rank, world_size, directory):
    straight = _epochs(world_size, 2)
    _epochs(world_size, 1, directory)
    resumed = _epochs(world_size, 2, resume=f"{directory}/last.ckpt")
    as_zero0 = _epochs(world_size, 2, resume=f"{directory}/last.ckpt", zero=0, main=False)
    return straight, resumed, as_zero0


def test_fp32_main_params_are_checkpointed_and_resume_exactly(tmp_path):
    from lightning_seqpar.checkpoint.safe_reader import read_metadata

    straight, resumed, as_zero0 = run_distributed(_resumes, 4, str(tmp_path))[0]
    for key in straight:  # the float32 copies carry what the bfloat16 weights cannot: the same run, bit for bit
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)
    stored = read_metadata(tmp_path / "last.ckpt").state_dict_metadata
    mains = [k for k in stored if k.endswith(".main_param")]
    assert mains and all(stored[k].properties.dtype == torch.float32 for k in mains)
    assert as_zero0.keys() == straight.keys()  # zero=0 resumes from it too (its parameters are updated in place)


def test_fp32_main_params_need_zero1():
    with pytest.raises(ValueError, match="needs zero=1"):
        strategy_of(tp=2, fp32_main_params=True)
