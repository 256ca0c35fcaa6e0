"""A sharded checkpoint written under context parallelism resumes at another cp size (and from tp into cp), its
weights and AdamW state resharded, on the loss curve of the uninterrupted one-process run (a Hugging Face Llama,
float64, ``model(input_ids=x, labels=x)``)."""

from __future__ import annotations

import pytest

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build
from tests.helpers.resume import EPOCH_STEPS, reference_epochs, train_epochs

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

def _run(rank, world, tp, cp, pp, epochs, directory, resume):
    return train_epochs(rank, world, SeqParallelStrategy(tp=tp, cp=cp, pp=pp), build("hf", labels=True, kv_heads=4),
                        epochs, directory, resume)


def _reference():
    return reference_epochs(build("hf", labels=True, kv_heads=4).double(), 2)


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Epoch 1 under each saving layout, checkpointed: {name: (losses, last.ckpt)}."""
    out = {}
    for name, world, tp, cp in [("cp2", 2, 1, 2), ("tp2xcp2", 4, 2, 2), ("tp2", 2, 2, 1)]:
        directory = tmp_path_factory.mktemp(name)
        losses = run_distributed(_run, world, tp, cp, 1, 1, str(directory), None)[0]
        out[name] = (losses, directory / "last.ckpt")
    return out


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)


@pytest.mark.parametrize("source, world, tp, cp, pp", [
    ("cp2", 1, 1, 1, 1),        # cp 2 -> one process
    ("cp2", 4, 1, 4, 1),        # cp 2 -> cp 4
    ("tp2xcp2", 4, 4, 1, 1),    # tp 2 x cp 2 -> tp 4
    ("tp2xcp2", 4, 1, 2, 2),    # tp 2 x cp 2 -> pp 2 x cp 2
    ("tp2", 4, 2, 2, 1),        # tp 2 -> tp 2 x cp 2
])
def test_resume_at_another_context_parallel_size_continues_the_one_process_curve(saved, reference, source, world, tp,
                                                                                 cp, pp):
    first, checkpoint = saved[source]
    _close(first, reference[:EPOCH_STEPS])
    resumed = run_distributed(_run, world, tp, cp, pp, 2, "", str(checkpoint))[0]
    _close(resumed, reference[EPOCH_STEPS:])
