"""A LoRA run's sharded checkpoint resumes under another layout (tp 2 → one process), its adapters and
their AdamW state resharded, on the loss curve of the uninterrupted one-process PEFT run; a checkpoint that lost
one tensor-parallel rank's file is refused before any weight is read."""

from __future__ import annotations

import pytest

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

MODEL = dict(labels=True, kv_heads=4, lora="all")


def _run(rank, world, tp, pp, epochs, directory, resume):
    return train_epochs(rank, world, SeqParallelStrategy(tp=tp, pp=pp), build("hf", **MODEL), epochs, directory, resume)


@pytest.fixture(scope="module")
def reference():
    return reference_epochs(build("hf", **MODEL).double(), 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora_tp2")
    losses = run_distributed(_run, 2, 2, 1, 1, str(directory), None)[0]
    return losses, directory / "last.ckpt"


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("world, tp, pp", [(1, 1, 1)], ids=["tp2-to-one-process"])  # into pp: test_lora_checkpoint_base
def test_a_lora_checkpoint_resumes_under_another_layout_on_the_one_process_curve(saved, reference, world, tp, pp):
    first, checkpoint = saved
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, pp, 2, None, str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])


def test_a_checkpoint_missing_one_tensor_parallel_rank_is_refused(saved, tmp_path):
    import shutil

    _, checkpoint = saved
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, damaged)
    files = sorted(p for p in damaged.rglob("*") if p.is_file() and "1" in p.stem and p.suffix == ".distcp")
    assert files, sorted(p.name for p in damaged.rglob("*"))
    files[0].unlink()
    with pytest.raises(AssertionError) as refused:
        run_distributed(_run, 2, 2, 1, 2, None, str(damaged))
    assert f"{files[0].name}: missing" in str(refused.value) and "is not what was written" in str(refused.value)
