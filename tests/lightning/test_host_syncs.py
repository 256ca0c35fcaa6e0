"""No host syncs in the training step: ``HostSyncCounter`` counts ``aten._local_scalar_dense`` (behind ``.item()``,
``float()`` of a tensor) with a dispatch mode, and ``Tensor.tolist`` (which on CPU reaches no dispatch mode) by a wrapper,
around the strategy's training step and backward, every step after the first (which exchanges the pipeline's activation shapes
once), for tp 2, pp 2 x tp 2, the interleaved schedule and context parallelism."""

import pytest

from lightning_seqpar import HostSyncCounter
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CASES = {
    2: [Case("gpt", 2, True, "selective"),
        Case("gpt", 1, True, None, (("n_layer", 4),), (), (("virtual_stages", 2), ("num_microbatches", 4)), 2, batch=4),
        Case("gpt", 1, True, None, cp=2),  # context parallel: the ring's transfers, the loss over cp
        Case("hf", 1, True, None, (("labels", True), ("documents", True), ("padding", True)),
             strategy=(("cp_comm", "all_to_all"), ("loss_chunk", 2)), cp=2)],  # + masks, documents, chunked loss
    4: [Case("gpt", 2, True, "selective", (), (), (), 2),
        Case("gpt", 1, True, None, (), (), (("zero", 1),), 2)],  # pp 2 x dp 2: buckets reduce-scatter in the schedule
}


def _counts(rank, world_size):
    out = []
    for case in CASES[world_size]:
        syncs = HostSyncCounter()
        fit(case, world_size, callbacks=[syncs])
        out.append(syncs.per_step)
    return out


def test_no_host_sync_in_the_training_step_after_the_first():
    for world_size in CASES:
        for rank, per_case in enumerate(run_distributed(_counts, world_size)):
            for case, per_step in zip(CASES[world_size], per_case):
                assert len(per_step) == 3 and per_step[1:] == [0, 0], (world_size, rank, case, per_step)
