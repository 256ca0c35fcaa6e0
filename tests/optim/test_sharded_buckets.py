"""The distributed optimizer's gradient side: buckets reduce-scattered over the data-parallel group, started during
the armed (last) backward as soon as a bucket's last gradient exists, leaving each rank the exact average of its
element range of every parameter, with no concatenation and no host read; host-side flags exchanged on gloo twins of
the mesh's groups."""

import pytest
import torch

from lightning_seqpar.optim.gradients import used_anywhere
from lightning_seqpar.optim.sharded_buckets import ShardedGradientBuckets
from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from tests.optim.test_gradient_buckets import _loss, _model
from tests.helpers.distributed import run_distributed
from tests.helpers.op_counter import CAT, HOST_READ, OpCounter

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

WATCHED = {CAT: "cat", HOST_READ: "host read"}


def _reduce(rank, world_size, dtype):
    group = ParallelGroup(torch.distributed.group.WORLD)
    model, reference = _model(dtype, last_width=15), _model(dtype, last_width=15)  # a 15-element bias: uneven ranges
    log = group.log = CommunicationLog()
    params = list(model.parameters())
    buckets = ShardedGradientBuckets(params, group, bucket_bytes=16 * 17 * 4)  # one layer per bucket
    assert len(buckets.buckets) == 4
    _loss(model, rank, 0, log).backward()  # an accumulation step: not armed, nothing is reduced
    assert log.events == ["layer 0 backward begins"]
    log.clear()
    with buckets.reducing():
        _loss(model, rank, 1, log).backward()
    dropped = all(p.grad is None for p in params)  # the buckets hold the only copy
    with OpCounter(WATCHED) as counter:
        used = buckets.finish()
    for step in (0, 1):  # reference: both backward passes, one float32 all-reduce, the mean, this rank's range
        _loss(reference, rank, step).backward()
    exact = []
    for p, q in zip(params, reference.parameters()):
        g = q.grad.float().reshape(-1)
        torch.distributed.all_reduce(g)
        start, stop = owned_range(p.numel(), world_size, rank)
        exact.append(torch.equal(buckets.owned_gradient(p), (g / world_size)[start:stop]))
    return log.events, all(exact), dropped, used, counter.counts


def test_sharded_buckets_start_before_the_first_layers_backward_and_average_each_range_exactly():
    for dtype in (torch.float32, torch.bfloat16):
        for events, exact, dropped, used, counts in run_distributed(_reduce, 2, dtype):
            starts = [i for i, e in enumerate(events) if e == "reduce_scatter start"]
            assert len(starts) == 4 and starts[0] < events.index("layer 0 backward begins"), events
            assert exact and dropped and all(used)
            assert counts == {"cat": 0, "host read": 0}


def test_owned_ranges_cover_every_element_once():
    for numel in (1, 7, 64, 65):
        for d in (1, 2, 3, 4, 8):
            ranges = [owned_range(numel, d, r) for r in range(d)]
            assert ranges[0][0] == 0 and ranges[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(stop - start for start, stop in ranges) == -(-numel // d)


def _host_flags(rank, world_size):
    mesh = ParallelMesh.build(1, 2, "cpu", host_groups=True)  # pp 2 x dp 2, gloo twins as under NCCL
    data, pipeline = mesh.host("data"), mesh.host("pipeline")
    with OpCounter(WATCHED) as counter:
        over_data = used_anywhere([rank == 0, rank == 3, False], data)
        over_pipeline = used_anywhere([rank == 0, rank == 3, False], pipeline)
    return (data is not mesh.data, torch.distributed.get_backend(data.group), data.size, pipeline.size,
            mesh.host("embedding") is pipeline, over_data, over_pipeline, counter.counts["host read"])


def test_host_flags_are_or_ed_over_gloo_twins_without_a_device_read():
    out = run_distributed(_host_flags, 4)
    for rank, (twin, backend, d, p, embedding, over_data, over_pipeline, reads) in enumerate(out):
        assert twin and backend == "gloo" and d == 2 and p == 2 and embedding and reads == 0
        data_peers = {rank, rank ^ 1}  # rank = dp + 2·pp (tp 1)
        pipeline_peers = {rank, rank ^ 2}
        assert over_data == [0 in data_peers, 3 in data_peers, False]
        assert over_pipeline == [0 in pipeline_peers, 3 in pipeline_peers, False]


def _counted(rank, world_size):
    from recipes.benchmarking.comm_counter import CollectiveCounter

    group = ParallelGroup(torch.distributed.group.WORLD)
    group.log = CommunicationLog()
    with CollectiveCounter(world_size) as counter:
        group.reduce_scatter(torch.ones(8, 3))
        group.all_gather(torch.ones(4, 3))
        group.all_reduce(torch.ones(5))
        group.reduce_scatter_start(torch.ones(6)).wait()
    return {k: (counter.log.bytes_moved(k), group.log.bytes_moved(k)) for k in ("reduce_scatter", "all_gather", "all_reduce")}


def test_the_benchmarks_collective_counter_agrees_with_the_communication_log():
    for counted in run_distributed(_counted, 2):
        assert all(seen == logged > 0 for seen, logged in counted.values()), counted
