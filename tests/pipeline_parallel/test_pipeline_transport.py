"""Pipeline transfers as NCCL needs them, observed on gloo: every message in a ``batch_isend_irecv`` with tag 0
(matched by order alone), shape headers only in the first step of a micro-batch shape, and the batches each rank
posts are those of the program the NCCL model checks (tests/pipeline_parallel/test_pipeline_nccl_model.py)."""

import pytest
import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_seqpar.pipeline_parallel.comm_plan import Batch, build_program
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CASES = [Case("gpt", 1, True, None, (("n_layer", 4),), (), (("virtual_stages", 2), ("num_microbatches", 4)), 2, batch=4),
         Case("gpt", 1, True, None, (), (), (), 2)]


class _PerStep(pl.Callback):
    def __init__(self):
        self.header_bytes, self.batches = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log = trainer.strategy.pipeline.executor.transport.log
        self.header_bytes.append(log.header_bytes)
        self.batches.append(log.batches)


def _transfers(rank, world_size):
    posted = []
    original = dist.batch_isend_irecv

    def recording(ops):
        posted.append([op.tag for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording  # looked up on the module by the transport at each call
    results = []
    for case in CASES:
        posted.clear()
        per_step = _PerStep()
        fit(case, world_size, callbacks=[per_step])
        config = dict(case.strategy)
        layout_v = config.get("virtual_stages", 1)
        results.append((list(posted), per_step.header_bytes, per_step.batches, layout_v,
                        config.get("num_microbatches", 2)))
    return results


def test_transfers_are_batched_untagged_and_shapes_are_sent_once():
    from lightning_seqpar.pipeline_parallel.layout import StageLayout

    for rank, per_case in enumerate(run_distributed(_transfers, 2)):
        for posted, header_bytes, batches, v, m in per_case:
            assert posted and all(tag == 0 for tags in posted for tag in tags)
            assert header_bytes[0] > 0 and header_bytes[1:] == [header_bytes[0]] * (len(header_bytes) - 1)
            schedule = "interleaved_1F1B" if v > 1 else "1F1B"
            plain = sum(isinstance(s, Batch) for s in build_program(schedule, m, StageLayout(2, v, (1,) * (2 * v)), rank))
            assert [b - a for a, b in zip(batches, batches[1:])] == [plain] * (len(batches) - 1)


def _posted_by_pair(rank, world_size):
    # Every p2p operation this rank posts, in order: (send?, peer, elements, dtype). NCCL matches a pair's sends and
    # receives by this order alone.
    posted = []
    original = dist.batch_isend_irecv

    def recording(ops):
        posted.extend((op.op is dist.isend, op.peer, op.tensor.numel(), op.tensor.dtype, op.tag) for op in ops)
        return original(ops)

    dist.batch_isend_irecv = recording
    fit(Case("gpt", 1, True, None, (("n_experts", 8), ("aux_loss_coef", 0.5), ("z_loss_coef", 0.1)), (),
             (("num_microbatches", 2),), 2, microbatches=2), world_size)
    return posted


def test_router_statistics_ride_beside_each_message_in_the_order_nccl_matches():
    # A mixture's router statistics ([2E+4] float32) go beside every activation and gradient: two operations per
    # message, and each rank's sends to its peer are, one for one in order, the peer's receives from it.
    ops = run_distributed(_posted_by_pair, 2)
    for rank, peer in ((0, 1), (1, 0)):
        sends = [(n, dtype) for send, to, n, dtype, _ in ops[rank] if send and to == peer]
        receives = [(n, dtype) for send, frm, n, dtype, _ in ops[peer] if not send and frm == rank]
        assert sends and sends == receives
    assert all(tag == 0 for posted in ops for *_, tag in posted)
    carried = [op for posted in ops for op in posted if op[2] == 2 * 8 + 4 and op[3] == torch.float32]
    activations = [op for posted in ops for op in posted if op[2] > 2 * 8 + 4 and op[3] != torch.int64]
    assert carried and len(carried) == len(activations)


class _Order(pl.Callback):
    """The rank's events in order: each batch posted and waited for (by its index), and each action run."""

    def __init__(self, events):
        self.events = events

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append(("step", batch_idx))
        trainer.strategy.pipeline.executor.observers.append(lambda action, _: self.events.append(("run", action)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.pipeline.executor.observers.clear()


def _order(rank, world_size):
    events, original = [], dist.batch_isend_irecv

    class Logged:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append(("wait", self.index))
            return self.work.wait()

    def recording(ops):
        index = sum(kind == "post" for kind, _ in events)
        events.append(("post", index))
        return [Logged(work, index) for work in original(ops)]

    dist.batch_isend_irecv = recording
    fit(Case("gpt", 1, True, None, (), (), (("schedule", "ZB-H1"), ("num_microbatches", 4)), 2, batch=4), world_size,
        callbacks=[_Order(events)])
    return [(kind, repr(value) if kind == "run" else value) for kind, value in events]


def test_a_batch_is_waited_for_only_when_an_action_needs_what_it_receives():
    """Transfers run under the actions after them (Megatron-LM's overlapped p2p): a batch is waited for when an action
    needs what it receives, or at the step's end; its sends meanwhile go on. Under ZB-H1 the last stage's B sends its
    input gradient and the W after it runs while that send is in flight. In the first step, whose batches carry shape
    headers, a batch that receives one is waited for at once (the next batches are built from the shapes it reads)."""
    for rank, events in enumerate(run_distributed(_order, 2)):
        second = events[events.index(("step", 1)):events.index(("step", 2))]
        waits = [value for kind, value in second if kind == "wait"]
        posts = [value for kind, value in second if kind == "post"]
        assert sorted(set(waits)) == posts  # every batch posted is waited for
        open_batches, overlapped = set(), []
        for kind, value in second:
            if kind == "post":
                open_batches.add(value)
            elif kind == "wait":
                open_batches.discard(value)
            elif kind == "run" and open_batches:
                overlapped.append(value)
        assert not open_batches  # every batch waited for by the step's end
        if rank == 1:  # the last stage: every W but the last runs beside its B's gradient send
            assert [a for a in overlapped if a.startswith("W")] == ["W0", "W1", "W2", "W3"], second
        else:  # the first stage's forwards run while their activations go to stage 1
            assert any(a.startswith("F") for a in overlapped), second
