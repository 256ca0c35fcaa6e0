"""An element range of a shard as checkpoint chunks: contiguous pieces of the range that tile the single-device
tensor exactly once over every (tensor, data)-parallel coordinate, vocabulary padding left out."""

import itertools

import pytest
import torch

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.dcp_ranges import _chunks, _owned, range_boxes
from lightning_seqpar.tensor_parallel.sharding import saved_shape
from lightning_seqpar.parallel.placement import ShardSpec, set_shard_spec


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 1, 4)])
def test_a_range_is_contiguous_boxes_that_cover_it_once(shape):
    numel = torch.Size(shape).numel()
    for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
        covered = torch.zeros(shape, dtype=torch.int64)
        for offsets, sizes, flat in range_boxes(shape, start, stop):
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            covered[box] += 1
            where = torch.zeros(shape, dtype=torch.bool)
            where[box] = True
            assert where.reshape(-1).nonzero().flatten().tolist() == list(range(flat, flat + where.sum()))
        want = torch.zeros(numel, dtype=torch.int64)
        want[start:stop] = 1
        assert covered.reshape(-1).tolist() == want.tolist()
        assert len(range_boxes(shape, start, stop)) <= 2 * len(shape)


def _local(full_shape, spec, tp, rank):
    shape = list(full_shape)
    shape[spec.dim] = spec.padded_size // tp
    param = torch.nn.Parameter(torch.empty(shape))
    set_shard_spec(param, spec)
    return param


@pytest.mark.parametrize("case", ["column", "row", "fused qkv", "fused qkv, grouped-query", "padded vocabulary",
                                  "replicated"])
@pytest.mark.parametrize("tp, dp", [(1, 3), (2, 2), (4, 3)])
def test_every_coordinate_s_chunks_tile_the_single_device_tensor_once(case, tp, dp):
    full, spec = {
        "column": ((8, 6), ShardSpec(0, 8, 8)),
        "row": ((6, 8), ShardSpec(1, 8, 8)),
        "fused qkv": ((24, 5), ShardSpec(0, 24, 24, chunks=3)),
        # q of 4 heads and k, v of 1 (head_dim 3 · t): the three blocks of unequal sizes, each split over t
        "fused qkv, grouped-query": ((18 * tp, 5), ShardSpec(0, 18 * tp, 18 * tp, 3, (12 * tp, 3 * tp, 3 * tp))),
        "padded vocabulary": ((10, 3), ShardSpec(0, 10, -(-10 // tp) * tp)),
        "replicated": ((5, 7), None),
    }[case]
    covered = torch.zeros(saved_shape(spec, full), dtype=torch.int64)
    values = torch.arange(torch.Size(full).numel()).reshape(full)  # each element its own single-device index
    saved_values = values.reshape(saved_shape(spec, full))
    for i in range(tp if spec is not None else 1):
        param = _local(full, spec, tp, i) if spec is not None else torch.nn.Parameter(torch.empty(full))
        local = spec.shard(values, ParallelGroup.virtual(tp, i)).reshape(-1) if spec is not None else values.reshape(-1)
        for j in range(dp):
            start, stop = _owned(param.numel(), dp, j)
            for offsets, sizes, flat in _chunks(param, i, start, stop):
                box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                covered[box] += 1
                n = torch.Size(sizes).numel()
                assert start <= flat and flat + n <= stop
                assert local[flat:flat + n].tolist() == saved_values[box].reshape(-1).tolist()  # where it lives
    assert covered.min() == 1 and covered.max() == 1
