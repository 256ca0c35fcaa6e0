"""A mixture of experts' checkpoints reshard across expert-parallel and expert tensor-parallel sizes: saved sharded at
tp 2 × ep 2, resumed with each expert's width split too (expert_tp 2), then into every rank holding half of every
expert (ep 1 × expert_tp 2) and saved as one full-format file, then split four ways (ep 4), then into a pipeline of 2
stages at ep 2, then into one at expert_tp 2: on the loss curve of the uninterrupted one-process run."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(family="qwen3_moe", labels=True)
# Each an epoch, resumed from the one before; the third saves one full-format file (gathered over etp, then ep).
LAYOUTS = (dict(tp=2, ep=2), dict(tp=2, ep=2, expert_tp=2), dict(tp=2, ep=1, expert_tp=2, checkpoint_format="full"),
           dict(tp=1, ep=4), dict(tp=1, pp=2, ep=2), dict(tp=2, pp=2, expert_tp=2))


def _lives(rank, world, root):
    losses = []
    for epoch, layout in enumerate(LAYOUTS):
        losses += train_epochs(rank, world, strategy_of(**layout), build("hf", **MODEL), epoch + 1,
                               f"{root}/epoch{epoch}", f"{root}/epoch{epoch - 1}/last.ckpt" if epoch else None)
    return losses


def test_experts_reshard_across_ep_and_expert_tp_full_and_into_pp_on_the_one_process_curve(tmp_path):
    torch.manual_seed(0)
    want = reference_epochs(build("hf", **MODEL).double(), len(LAYOUTS))
    got = run_distributed(_lives, 4, str(tmp_path))[0]
    assert len(got) == len(want) == EPOCH_STEPS * len(LAYOUTS)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)
