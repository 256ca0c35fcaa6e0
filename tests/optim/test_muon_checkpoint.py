"""Muon's momentum in a sharded checkpoint: saved at tp 2, resumed at tp 1 (one process, and two data-parallel
replicas) and tp 4: the buffers come back as the single-device ones, bit for bit (shaped like the shards, they are
resharded as AdamW's moments are); saved under zero=1 (element ranges), resumed at tp 1 and tp 4; every run continues
the uninterrupted one-process curve."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_optimizer_state
from tests.helpers.distributed import run_distributed
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs
from tests.optim.test_muon import MuonLM
from tests.helpers.strategy import strategy_of

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
        super().__init__("llama", kv_heads=4)  # four key/value heads: tp 4 splits them
        self.watch = _Momentum()

    def configure_callbacks(self):
        return [self.watch]


def _run(rank, world, tp, epochs, directory, resume, zero=0):
    torch.manual_seed(0)
    module = _Watched()
    losses = train_epochs(rank, world, strategy_of(tp=tp, zero=zero), module, epochs, directory, resume)
    return losses, module.watch.seen


def test_muon_resumes_under_another_layout_with_its_momentum_on_the_one_process_curve(tmp_path):
    torch.manual_seed(0)
    reference = reference_epochs(MuonLM("llama", kv_heads=4), 2)
    first, saved = run_distributed(_run, 2, 2, 1, str(tmp_path / "tp2"), None)[0]
    first_zero1, _ = run_distributed(_run, 4, 2, 1, str(tmp_path / "zero1"), None, 1)[0]
    assert len(saved["end"]) == 14  # every matrix has its buffer
    for source, world, tp in (("tp2", 1, 1), ("tp2", 2, 1), ("tp2", 4, 4), ("zero1", 1, 1), ("zero1", 4, 4)):
        resumed, loaded = run_distributed(_run, world, tp, 2, "", str(tmp_path / source / "last.ckpt"))[0]
        assert loaded["start"].keys() == saved["end"].keys()
        for name, buffer in saved["end"].items():
            if source == "tp2":  # written and read back: bit for bit
                torch.testing.assert_close(loaded["start"][name], buffer, rtol=0, atol=0, msg=name)
            else:  # another run's ranges (zero=1, tp 2 x dp 2) of the same curve
                assert (loaded["start"][name] - buffer).norm() <= 1e-6 * buffer.norm(), name
        got = (first if source == "tp2" else first_zero1) + resumed
        assert len(got) == len(reference) == 2 * EPOCH_STEPS
        for g, w in zip(got, reference):
            assert abs(g - w) <= 1e-6 * abs(w), (source, world, tp, got, reference)
