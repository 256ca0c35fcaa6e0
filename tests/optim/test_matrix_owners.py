"""Whole matrices out of shards (:mod:`lightning_seqpar.optim.matrix_owners`) on emulated ranks: each matrix's result
is the function of the single-device matrix, run once on one owner, every rank given its piece; the bytes moved are
the formula's."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.optim.matrix_owners import Matrix, exchange_bytes, owners, process_whole
from lightning_seqpar.parallel import CommunicationLog
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.parallel.placement import ShardSpec

# (single-device shape, split) of each matrix: rows, columns, vocabulary padding, fused blocks of unequal sizes, a
# replicated matrix, a stack of experts split along a matrix dim
SHAPES = [
    ((12, 8), ShardSpec(0, 12, 12)),
    ((8, 12), ShardSpec(1, 12, 12)),
    ((10, 6), ShardSpec(0, 10, 12)),
    ((16, 4), ShardSpec(0, 16, 16, chunks=3, chunk_sizes=(8, 4, 4))),
    ((6, 5), None),
    ((3, 8, 4), ShardSpec(1, 8, 8)),
]


def _fulls():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape, _ in SHAPES]


def _function(full: torch.Tensor) -> torch.Tensor:
    """Not element-wise: every element of the result reads the whole matrix (of each matrix of a stack)."""
    return full * full.square().sum(dim=(-2, -1), keepdim=True).sqrt() + full.flip(-1).cumsum(-2)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_each_rank_gets_its_piece_of_the_function_of_the_whole_matrix(size):
    fulls = _fulls()

    def rank(group):
        matrices = [Matrix(spec.shard(full, group) if spec is not None else full.clone(), spec)
                    for full, (_, spec) in zip(fulls, SHAPES)]
        calls = []

        def counted(matrix):
            calls.append(tuple(matrix.shape))
            return _function(matrix)

        group.log = CommunicationLog()
        out = process_whole(matrices, group, counted, torch.float64)
        return out, calls, group.log.bytes_moved("all_to_all_v"), [m.local for m in matrices]

    results = run_emulated(size, rank)
    for index, (full, (_, spec)) in enumerate(zip(fulls, SHAPES)):
        want = _function(full)
        for r, (out, _, _, _) in enumerate(results):
            expected = spec.shard(want, _Rank(size, r)) if spec is not None else want
            torch.testing.assert_close(out[index], expected, rtol=0, atol=0)
    # each matrix computed once, on its owner, whole
    assert sorted(shape for _, calls, _, _ in results for shape in calls) == sorted(tuple(f.shape) for f in fulls)
    owner = owners([Matrix(local, spec) for local, (_, spec) in zip(results[0][3], SHAPES)], size)
    for r, (_, calls, _, _) in enumerate(results):
        assert calls == [tuple(fulls[i].shape) for i in range(len(fulls)) if owner[i] == r]
    moved = sum(sent for _, _, sent, _ in results)
    assert moved == exchange_bytes([Matrix(local, spec) for local, (_, spec) in zip(results[0][3], SHAPES)],
                                   size, 8)
    assert (moved == 0) == (size == 1)


def test_owners_balance_the_work_from_the_shapes_alone():
    matrices = [Matrix(torch.empty(n, n), None) for n in (8, 8, 4, 4, 4, 4, 2)]
    assert owners(matrices, 2) == [0, 1, 0, 1, 0, 1, 0]
    assert owners(matrices, 1) == [0] * 7


class _Rank:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank
