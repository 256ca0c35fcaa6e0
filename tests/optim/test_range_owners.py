"""ZeRO-1's element ranges gathered whole to their owners and scattered back (:mod:`lightning_seqpar.optim.
range_owners`) on emulated ranks: uneven ranges (a tensor of fewer elements than ranks included), any owners."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.optim.range_owners import gather_ranges, scatter_ranges
from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.parallel.emulated import run_emulated

NUMELS = [10, 3, 16, 7]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_owner_gets_the_whole_tensor_and_every_rank_its_range_of_the_result_back(size):
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(n, generator=g, dtype=torch.float64) for n in NUMELS]
    owner = [i % size for i in range(len(NUMELS))][::-1]

    def rank(group):
        ranges = [w[slice(*owned_range(w.numel(), group.size, group.rank))] for w in wholes]
        got = gather_ranges(ranges, NUMELS, group, owner, torch.float64)
        assert sorted(got) == [i for i, o in enumerate(owner) if o == group.rank]
        for i, whole in got.items():
            torch.testing.assert_close(whole, wholes[i], rtol=0, atol=0)
        back = scatter_ranges({i: 2 * whole for i, whole in got.items()}, NUMELS, group, owner, torch.float64,
                              torch.device("cpu"))
        for piece, mine in zip(back, ranges):
            torch.testing.assert_close(piece, 2 * mine, rtol=0, atol=0)
        return True

    assert all(run_emulated(size, rank))
