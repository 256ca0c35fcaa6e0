"""The training sampler's order is one global order for every data-parallel size, and its saved position (the global
sample index) resumes under any other size, batch or accumulation at the same sample."""

import logging

import pytest
from torch.utils.data import DistributedSampler

from lightning_seqpar.data.global_order import GlobalOrderSampler

N, SEED = 23, 7


def _samplers(d: int, global_batch: int, epoch: int = 0) -> list[GlobalOrderSampler]:
    samplers = [GlobalOrderSampler(range(N), d, q, SEED, global_batch) for q in range(d)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return samplers


def _steps(samplers: list[GlobalOrderSampler], b: int, steps: int) -> list[set[int]]:
    """The samples of each step's global batch: every rank's next ``b`` indices, ``steps`` times."""
    iterators = [iter(s) for s in samplers]
    return [{next(it) for it in iterators for _ in range(b)} for _ in range(steps)]


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_without_a_resume_each_rank_yields_what_distributed_sampler_yields(d):
    for q, sampler in enumerate(_samplers(d, 4, epoch=2)):
        reference = DistributedSampler(range(N), num_replicas=d, rank=q, shuffle=True, seed=SEED)
        reference.set_epoch(2)
        assert list(sampler) == list(reference) and len(sampler) == len(reference)


def test_the_global_batches_are_the_same_samples_at_every_data_parallel_size():
    assert _steps(_samplers(1, 4), 4, 5) == _steps(_samplers(2, 4), 2, 5) == _steps(_samplers(4, 4), 1, 5)


@pytest.mark.parametrize("saved_d, resumed_d", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_position_saved_at_one_size_resumes_at_another_on_the_uninterrupted_order(saved_d, resumed_d):
    global_batch, done = 4, 3
    straight = _steps(_samplers(1, global_batch), global_batch, 5)
    saving = _samplers(saved_d, global_batch)
    assert _steps(saving, global_batch // saved_d, done) == straight[:done]
    state = saving[0].state_dict()  # rank 0's, as the checkpoint holds it
    assert state == {"epoch": 0, "global_index": done * global_batch, "seed": SEED, "size": N,
                     "global_batch": global_batch}
    resumed = _samplers(resumed_d, global_batch)
    for sampler in resumed:
        sampler.load_state_dict(state)
    assert _steps(resumed, global_batch // resumed_d, 2) == straight[done:]
    # Every rank yields as many samples (padding by wrapping), so no rank waits on a collective the others skip.
    assert len({len(list(s)) for s in _samplers(resumed_d, global_batch)}) == 1


def test_the_saved_position_applies_to_its_epoch_only():
    saving = _samplers(2, 4, epoch=1)
    _steps(saving, 2, 2)
    resumed = _samplers(2, 4, epoch=1)
    for sampler in resumed:
        sampler.load_state_dict(saving[1].state_dict())
    assert sum(len(list(s)) for s in resumed) == N - 8 + (N - 8) % 2
    for sampler in resumed:
        sampler.set_epoch(2)
    fresh = _samplers(2, 4, epoch=2)
    assert [list(s) for s in resumed] == [list(s) for s in fresh]


def test_another_global_batch_continues_at_the_same_sample_and_says_so(caplog):
    saving = _samplers(2, 4)
    _steps(saving, 2, 2)
    resumed = _samplers(1, 8)
    with caplog.at_level(logging.WARNING, logger="lightning_seqpar.data.global_order"):
        resumed[0].load_state_dict(saving[0].state_dict())
    assert [r.getMessage() for r in caplog.records] == [
        "resume: continuing at global sample 8 of epoch 0 with a global batch of 8 samples per optimizer step (the "
        "checkpoint's run took 4): the same samples follow, grouped into other steps."]
    assert list(resumed[0])[:4] == saving[0].order(0)[8:12]


def test_another_dataset_starts_the_epoch_again_and_says_so(caplog):
    saving = _samplers(2, 4)
    _steps(saving, 2, 2)
    other = GlobalOrderSampler(range(N + 1), 1, 0, SEED, 4)
    with caplog.at_level(logging.WARNING, logger="lightning_seqpar.data.global_order"):
        other.load_state_dict(saving[0].state_dict())
    assert "starts again from its first sample" in caplog.text
    assert list(other) == other.order(0)
