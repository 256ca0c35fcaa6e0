"""Ring and all-to-all attention on 2 and 4 gloo processes against dense attention of the whole sequence on one
process (float64): outputs and the gradients of q, k and v, with grouped-query heads, packed documents, padding, a
sliding window and soft-capping, op by op and with the fused kernel; the bytes each rank sends equal :func:`bytes_per_layer`; the ring's transfers, as
posted, pass the model of NCCL's point-to-point rules."""

import pytest
import torch
import torch.distributed as dist

from lightning_seqpar.context_parallel import ContextParallelBatch, context_parallel_attention, local_indices
from lightning_seqpar.context_parallel.attention import bytes_per_layer
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.pipeline_parallel.comm_plan import Batch, Transfer
from lightning_seqpar.pipeline_parallel.nccl_model import check_programs
from tests.context_parallel.test_layout_and_blocks import _dense
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

B, A, A_KV, S, D = 2, 4, 2, 16, 3
SETTINGS = [  # (comm, window, softcap, documents, padding, fused kernel)
    ("ring", None, None, False, False, False),
    ("ring", 5, 1.5, True, True, False),
    ("ring", None, None, False, False, True),
    ("ring", 5, None, True, True, True),
    ("all_to_all", None, None, True, False, False),
    ("all_to_all", 3, None, False, True, False),
    ("all_to_all", 3, None, True, True, True),
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (A, A_KV, A_KV))
    grad = torch.randn(B, A, S, D, generator=g, dtype=torch.float64)
    documents = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * S])
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, -3:] = True
    return q, k, v, grad, documents, padding


def _on_ranks(rank, world_size):
    group = ParallelGroup(dist.group.WORLD)
    q, k, v, grad, documents, padding = _inputs()
    mine = local_indices(S, world_size, rank)
    results = []
    for comm, window, softcap, docs, pad, fused in SETTINGS:
        heads = (A, A) if comm == "all_to_all" and world_size > A_KV else (A, A_KV)  # a2a: kv heads divisible by c
        kk, vv = (x.repeat_interleave(heads[1] // A_KV, 1) for x in (k, v))
        layout = ContextParallelBatch(group, comm, S, documents if docs else None, padding if pad else None, window)
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, kk, vv)]
        group.log = CommunicationLog()
        out = context_parallel_attention(*local, layout, 0.5, softcap, fused)
        forward = {kind: group.log.bytes_moved(kind) for kind in ("ring_send", "all_to_all")}
        hops = group.log.count("ring_send")
        group.log.clear()
        out.backward(grad[:, :, mine])
        backward = {kind: group.log.bytes_moved(kind) for kind in ("ring_send", "all_to_all")}
        hops += group.log.count("ring_send")
        results.append((mine, out.detach(), [x.grad for x in local], forward, backward, heads, hops))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_and_all_to_all_attention_equal_dense_attention_and_their_formulas(world_size):
    per_rank = run_distributed(_on_ranks, world_size)
    q, k, v, grad, documents, padding = _inputs()
    for i, (comm, window, softcap, docs, pad, _) in enumerate(SETTINGS):
        heads = per_rank[0][i][5]
        kk, vv = (x.repeat_interleave(heads[1] // A_KV, 1).requires_grad_() for x in (k, v))
        qq = q.clone().requires_grad_()
        want = _dense(qq, kk, vv, 0.5, softcap, documents if docs else torch.zeros(B, S),
                      padding if pad else torch.zeros(B, S, dtype=torch.bool), window)
        want.backward(grad)
        formula = bytes_per_layer(comm, B, S, heads[0], heads[1], D, 1, world_size, 8)
        for rank in range(world_size):
            mine, out, grads, forward, backward, _, hops = per_rank[rank][i]
            torch.testing.assert_close(out, want.detach()[:, :, mine], rtol=1e-12, atol=1e-12)
            for got, x in zip(grads, (qq, kk, vv)):
                torch.testing.assert_close(got, x.grad[:, :, mine], rtol=1e-12, atol=1e-12)
            kind = "ring_send" if comm == "ring" else "all_to_all"
            assert forward[kind] == formula["forward"][kind] and backward[kind] == formula["backward"][kind]
        if comm == "ring":  # the exchanges every rank posted, in order, under NCCL's rules
            counts = {per_rank[r][i][6] for r in range(world_size)}
            assert counts == {3 * world_size - 2}  # forward c − 1, backward (c − 1) + c
            hops = counts.pop()
            assert check_programs([_ring_program(r, world_size, hops) for r in range(world_size)]) > 0


def _ring_program(rank: int, c: int, hops: int) -> list:
    """The batches one rank posts for ``hops`` ring transfers (as ``ParallelGroup.ring_exchange_start`` does: one
    ``batch_isend_irecv`` of the send to the next rank, then the receive from the previous one)."""
    return [Batch((Transfer(True, "kv", h, 0, (rank + 1) % c), Transfer(False, "kv", h, 0, (rank - 1) % c)))
            for h in range(hops)]


def test_a_ring_whose_ranks_post_in_another_order_fails_the_model():
    # The model catches the bug it exists for: a rank that receives before it sends, unbatched, would deadlock.
    programs = [[Batch((t,)) for t in reversed(_ring_program(r, 2, 1)[0].transfers)] for r in range(2)]
    with pytest.raises(RuntimeError):
        check_programs(programs)
