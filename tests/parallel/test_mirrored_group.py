"""A mirrored rank (:class:`~lightning_seqpar.parallel.mirrored.MirroredGroup`) receives from every collective what a
rank of a real group receives when all ranks hold its tensor: the same shape and the same values, checked against t
emulated ranks (threads) holding equal tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.parallel.mirrored import MirroredGroup

CALLS = {
    "all_reduce sum": lambda g, x: g.all_reduce(x.clone()),
    "all_reduce max": lambda g, x: g.all_reduce(x.clone(), dist.ReduceOp.MAX),
    "all_gather dim 0": lambda g, x: g.all_gather(x),
    "all_gather dim 1": lambda g, x: g.all_gather(x, dim=1),
    "reduce_scatter": lambda g, x: g.reduce_scatter(x),
    "all_gather_start": lambda g, x: g.all_gather_start(x).wait(),
    "reduce_scatter_start": lambda g, x: g.reduce_scatter_start(x).wait(),
    "ring_exchange_start": lambda g, x: g.ring_exchange_start(x).wait(),
    "broadcast": lambda g, x: g.broadcast(x.clone()),
    "all_to_all": lambda g, x: g.all_to_all(x.view(g.size, -1, 3)),
    # every rank sends 2 rows to rank 0 and 3 to rank 1, so rank 0 receives 2 from each, rank 1 3, the others none
    "all_to_all_v": lambda g, x: g.all_to_all_v(x[:5], [2, 3] + [0] * (g.size - 2),
                                                [{0: 2, 1: 3}.get(g.rank, 0)] * g.size),
}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_collective_delivers_what_ranks_holding_equal_tensors_do(name, size):
    x = torch.arange(size * 6 * 3, dtype=torch.float64).reshape(size * 6, 3)
    emulated = run_emulated(size, lambda group: CALLS[name](group, x))
    for rank in range(size):
        mirrored = CALLS[name](MirroredGroup(size, rank), x)
        assert mirrored.shape == emulated[rank].shape, (name, rank)
        torch.testing.assert_close(mirrored, emulated[rank], rtol=0, atol=0, msg=f"{name} on rank {rank}")


def test_every_collective_returns_storage_of_its_own():
    # The probes count what a collective delivers where it is made: a result sharing its input's storage would hide it.
    group, x = MirroredGroup(2), torch.ones(4, 3)
    for name in ("all_gather dim 0", "reduce_scatter", "ring_exchange_start", "all_to_all"):
        assert CALLS[name](group, x).untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), name


def test_shapes_a_real_group_refuses_are_refused():
    with pytest.raises(ValueError, match="divisible by the group size"):
        MirroredGroup(4).reduce_scatter(torch.ones(6, 2))
    with pytest.raises(ValueError, match="one split per rank"):
        MirroredGroup(2).all_to_all_v(torch.ones(3, 2), [1, 1], [1, 1])
    with pytest.raises(NotImplementedError, match="PRODUCT"):
        MirroredGroup(2).all_reduce(torch.ones(2), dist.ReduceOp.PRODUCT)
