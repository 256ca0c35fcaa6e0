"""Dropout streams: different masks where ranks hold different data, equal where replicated, replayed
by recomputation."""

import pytest
import torch

from lightning_seqpar.transformer.dropout import ParallelDropout
from tests.helpers.distributed import run_distributed
from tests.helpers.models import Recorder
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


class MaskRecorder(Recorder):
    """Records, for the first step, which elements each ParallelDropout zeroed."""

    def on_fit_start(self, trainer, pl_module):
        self.masks = {}
        for name, module in pl_module.named_modules():
            if isinstance(module, ParallelDropout):
                module.register_forward_hook(self._hook(name, module))

    def _hook(self, name, module):
        def hook(mod, inputs, output):
            if name not in self.masks:
                self.masks[name] = (module.sharded, (output == 0).cpu())
        return hook


def _masks(rank, world_size):
    out = {}
    for sp in (True, False):
        recorder = MaskRecorder()
        fit(Case("gpt", 2, sp, None, (("dropout", 0.5),)), world_size, steps=1, callbacks=[recorder])
        out[sp] = recorder.masks
    for recompute in (None, "selective", "full"):
        rec = fit(Case("gpt", 2, True, recompute, (("dropout", 0.3),)), world_size)
        out[recompute] = (rec.losses, rec.grads)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_masks, 2)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_masks_differ_in_sharded_regions_and_agree_in_replicated_ones(runs, sequence_parallel):
    rank0, rank1 = runs[0][sequence_parallel], runs[1][sequence_parallel]
    assert rank0.keys() == rank1.keys() and len(rank0) == 1 + 2 * 2  # embedding + 2 per block
    for name, (sharded, mask0) in rank0.items():
        assert sharded == sequence_parallel, name  # hidden dropouts are sharded exactly under SP
        mask1 = rank1[name][1]
        if sharded:
            assert not torch.equal(mask0, mask1), f"{name}: sequence shards drew the same mask"
        else:
            assert torch.equal(mask0, mask1), f"{name}: replicated copies drew different masks"


def test_recomputation_replays_dropout_masks(runs):
    """With dropout on, selective and full recomputation train exactly like no recomputation."""
    for rank_runs in runs:
        losses, grads = rank_runs[None]
        for recompute in ("selective", "full"):
            other_losses, other_grads = rank_runs[recompute]
            assert other_losses == losses, recompute
            for step, g in enumerate(grads):
                for name, value in g.items():
                    assert torch.equal(other_grads[step][name], value), (recompute, step, name)
