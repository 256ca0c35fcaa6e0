"""The aux-loss-free expert bias update (ExpertBiasUpdate) equals one process with the same callback: GLM-4.5's
correction biases after 3 steps, and the losses they route, at tp 2 × ep 2 with whole layers recomputed (each token
counted once, not again in the recomputed forward); and a bad rate or a model without such a router is refused."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar.lightning.callbacks.expert_bias import ExpertBiasUpdate
from tests.helpers.distributed import run_distributed
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.models import BATCH, SEQ, Recorder, build, token_data
from tests.helpers.parity import STEPS, Case, fit

MODEL = dict(family="glm4_moe", labels=True)
CASE = Case("hf", 2, True, "full", tuple(MODEL.items()), (), (("ep", 2),))
pytestmark = pytest.mark.distributed

RATE = 0.05  # large enough that the biases change the routing within 3 steps


class Biases(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.final = {n: b.detach().clone() for n, b in pl_module.named_buffers() if n.endswith("e_score_correction_bias")}


class Counted(ExpertBiasUpdate):
    """Also records the (token, expert) choices this rank counted for each router and step."""

    def __init__(self, rate):
        super().__init__(rate)
        self.per_step = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.per_step.append(sorted(c.sum().item() for c in self._counts.values()))
        super().on_before_optimizer_step(trainer, pl_module, optimizer)


def _parallel(rank, world):
    biases, update = Biases(), Counted(RATE)
    recorder = fit(CASE, world, callbacks=[update, biases])
    return biases.final, recorder.logged, update.per_step


def test_the_bias_update_over_ranks_equals_one_process():
    biases, recorder = Biases(), Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ExpertBiasUpdate(RATE), biases, recorder])
    data = token_data(STEPS, 1)  # in the order Lightning's DistributedSampler(shuffle=True, seed=0) gives the ranks
    order = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    trainer.fit(build("hf", **MODEL), order)
    assert any(not torch.equal(b, torch.zeros_like(b)) for b in biases.final.values())  # the update moved them
    tokens = BATCH * SEQ // 2  # this rank's s/t·b tokens
    for final, logged, counted in run_distributed(_parallel, 2):
        assert counted == [[2.0 * tokens]] * STEPS  # k = 2 choices per token, once: not again in the recomputed forward
        assert final.keys() == biases.final.keys()
        for name, bias in biases.final.items():
            torch.testing.assert_close(final[name], bias, rtol=0, atol=0, msg=lambda m: f"{name}: {final[name]} {bias}")
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(recorder.logged), rtol=1e-6, atol=0)


def test_a_bad_rate_or_a_model_without_a_correction_bias_is_refused():
    with pytest.raises(ValueError, match=r"rate=0\): the bias step must be positive"):
        ExpertBiasUpdate(0)
    with pytest.raises(ValueError, match=r"no router with an expert correction bias"):
        ExpertBiasUpdate(0.1).on_fit_start(None, build("hf", family="qwen3_moe"))
