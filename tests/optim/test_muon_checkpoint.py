"""Muon's momentum in a sharded checkpoint: saved at tp 2, resumed at tp 1 (one process, and two data-parallel
replicas): the buffers come back as the single-device ones, bit for bit (shaped like the shards, they are resharded as
AdamW's moments are), and the run continues the uninterrupted one-process curve."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_optimizer_state
from tests.helpers.distributed import run_distributed
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs
from tests.optim.test_muon import MuonLM

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


class _Momentum(pl.Callback):
    """The Muon's momentum buffers as one process holds them: when a resumed run starts, when a run ends."""

    def __init__(self) -> None:
        self.seen = {}

    def _read(self, trainer, when):
        muon = trainer.strategy.optimizers[0]
        names = {id(p): n for n, p in trainer.lightning_module.named_parameters()}
        state = full_optimizer_state(muon, trainer.strategy.mesh)["state"]
        params = [p for g in muon.param_groups for p in g["params"]]
        self.seen[when] = {names[id(p)]: state[i]["momentum_buffer"] for i, p in enumerate(params) if i in state}

    def on_train_start(self, trainer, pl_module):
        self._read(trainer, "start")

    def on_train_end(self, trainer, pl_module):
        self._read(trainer, "end")


class _Watched(MuonLM):
    def __init__(self) -> None:
        super().__init__("llama")
        self.watch = _Momentum()

    def configure_callbacks(self):
        return [self.watch]


def _run(rank, world, tp, epochs, directory, resume):
    torch.manual_seed(0)
    module = _Watched()
    losses = train_epochs(rank, world, SeqParallelStrategy(tp=tp), module, epochs, directory, resume)
    return losses, module.watch.seen


def test_muon_resumes_under_another_layout_with_its_momentum_on_the_one_process_curve(tmp_path):
    torch.manual_seed(0)
    reference = reference_epochs(MuonLM("llama"), 2)
    first, saved = run_distributed(_run, 2, 2, 1, str(tmp_path), None)[0]
    assert len(saved["end"]) == 14  # every matrix has its buffer
    for world, tp in ((1, 1), (2, 1)):
        resumed, loaded = run_distributed(_run, world, tp, 2, "", str(tmp_path / "last.ckpt"))[0]
        assert loaded["start"].keys() == saved["end"].keys()
        for name, buffer in saved["end"].items():
            torch.testing.assert_close(loaded["start"][name], buffer, rtol=0, atol=0, msg=name)
        got = first + resumed
        assert len(got) == len(reference) == 2 * EPOCH_STEPS
        for g, w in zip(got, reference):
            assert abs(g - w) <= 1e-6 * abs(w), (world, tp, got, reference)
