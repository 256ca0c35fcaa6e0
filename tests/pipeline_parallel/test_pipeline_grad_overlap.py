"""Under a pipeline schedule the data-parallel buckets take each gradient (as the returned loss's backward would
combine it) during the last backward of its model chunk (layers) or of this rank (the rest), and start reducing
there, not after the schedule: pp 2 x dp 2, zero 0 (all-reduce) and zero 1 (reduce-scatter), with gradient
accumulation; interleaved with small buckets, each chunk's at its own last backward, trained like one process.
Parity with one process for the default buckets: test_pipeline_parity."""

import pytest
import lightning.pytorch as pl

from lightning_seqpar.parallel import CommunicationLog
from tests.lightning.test_parity import CLIP_ACCUMULATE
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, assert_matches_single_process, close, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


class _Order(pl.Callback):
    """Per optimizer step: the data-parallel group's collective events and the schedule's actions, in order."""

    def __init__(self):
        self.steps = []

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        self.log = strategy.mesh.data.log = CommunicationLog()
        strategy.pipeline.executor.observers.append(
            lambda action, in_flight: self.log.event(f"{action.kind} done"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(list(self.log.events))
        self.log.clear()


def _orders(rank, world_size):
    out = {}
    for zero in (0, 1):
        order = _Order()
        fit(Case("gpt", 1, True, None, (), CLIP_ACCUMULATE, (("zero", zero),), 2), world_size, callbacks=[order])
        out[zero] = order.steps
    return out


def test_buckets_start_reducing_inside_the_last_backward_of_the_schedule():
    for per_rank in run_distributed(_orders, 4):  # pp 2 x dp 2
        for zero, kind in ((0, "all_reduce"), (1, "reduce_scatter")):
            steps = per_rank[zero]
            assert steps, zero
            for events in steps:
                backward = [i for i, e in enumerate(events) if e == "B done"]
                starts = [i for i, e in enumerate(events) if e == f"{kind} start"]
                # The window's first batch ran its schedule before; the buckets start within this rank's last backward
                # (after the one before it, before it returns), not after the schedule.
                inside = [i for i in starts if backward[-2] < i < backward[-1]]
                assert inside and min(starts) == inside[0], (zero, events)
                if zero == 0:  # every bucket (parameters every stage holds are reduced with the stage sums)
                    assert inside == starts, events
                else:  # every bucket but the one of the parameters every stage holds, which starts after backward
                    assert len(starts) - len(inside) == 1 and len(inside) >= 1, events


class _SmallBuckets(_Order):
    """The same, with buckets of about one layer (the default 25 MiB would hold this whole model)."""

    def on_train_start(self, trainer, pl_module):
        from lightning_seqpar.optim import GradientBuckets
        from lightning_seqpar.optim.gradients import shared_over_stages

        strategy = trainer.strategy
        shared = set(map(id, shared_over_stages(list(pl_module.parameters()))))
        strategy.grad_sync.replace_buckets(GradientBuckets([p for p in pl_module.parameters() if id(p) not in shared],
                                                           strategy.mesh.data, overlap=False, bucket_bytes=8192))
        super().on_train_start(trainer, pl_module)


INTERLEAVED = Case("gpt", 1, True, None, (("n_layer", 4),), CLIP_ACCUMULATE,
                   (("virtual_stages", 2), ("num_microbatches", 4)), 2, batch=4)


def _interleaved(rank, world_size):
    order = _SmallBuckets()
    recorder = fit(INTERLEAVED, world_size, callbacks=[order])
    return {INTERLEAVED: recorder}, order.steps


def test_interleaved_chunks_start_their_buckets_at_their_own_last_backward():
    runs = run_distributed(_interleaved, 4)  # pp 2 x dp 2, two model chunks per rank, buckets of about a layer
    assert_matches_single_process([r for r, _ in runs], INTERLEAVED, 4, 1e-9, 1e-11, close(1e-9, 1e-11))
    for _, steps in runs:
        for events in steps:
            backward = [i for i, e in enumerate(events) if e == "B done"]
            starts = [i for i, e in enumerate(events) if e == "all_reduce start"]
            # the later chunk's layers are final before this rank's last backward begins: their buckets start then
            assert starts and min(starts) < backward[-2], events
            assert max(starts) < backward[-1], events  # and every bucket before the schedule ends
