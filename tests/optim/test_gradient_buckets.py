"""Data-parallel gradients reduced in buckets during backward: started as soon as a bucket's last gradient exists
(before the first layer's backward), only in the armed (last) backward of an accumulation window, averaged exactly,
in float32 for 16-bit gradients, without concatenating gradients."""

import pytest
import torch
import torch.nn as nn

from lightning_seqpar.optim import GradientBuckets, finalize_gradients
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from tests.helpers.distributed import run_distributed
from tests.helpers.op_counter import CAT, OpCounter

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _model(dtype, last_width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)], nn.Linear(16, last_width)).to(dtype)


def _loss(model, rank, step, log=None):
    torch.manual_seed(100 * step + rank)  # each data-parallel rank its own batch
    x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
    hidden = model[0](x)
    if log is not None:
        hidden.register_hook(lambda g: log.event("layer 0 backward begins"))
    for layer in model[1:]:
        hidden = layer(torch.tanh(hidden))
    return hidden.float().pow(2).mean()


def _reduce(rank, world_size, dtype):
    group = ParallelGroup(torch.distributed.group.WORLD)
    mesh = ParallelMesh.build(1, 1, "cpu")
    model, reference = _model(dtype), _model(dtype)
    log = group.log = CommunicationLog()
    buckets = GradientBuckets(model.parameters(), group, bucket_bytes=16 * 17 * 4)  # one layer per bucket
    assert len(buckets.buckets) == 4
    _loss(model, rank, 0, log).backward()  # an accumulation step: not armed, nothing is reduced
    assert group.log.events == ["layer 0 backward begins"]
    group.log.clear()
    with buckets.reducing():
        _loss(model, rank, 1, log).backward()
    counter = OpCounter({CAT: "cat"})
    with counter:
        finalize_gradients(model.parameters(), mesh, buckets.finish())
    events = group.log.events
    # reference: both backward passes, then one coalesced all-reduce (in float32) and the mean
    for step in (0, 1):
        _loss(reference, rank, step).backward()
    expected = []
    for p in reference.parameters():
        g = p.grad.float()
        torch.distributed.all_reduce(g)
        expected.append((g / world_size).to(dtype))
    exact = all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    return events, exact, counter.counts["cat"], [p.grad.dtype for p in model.parameters()]


def test_buckets_start_before_the_first_layers_backward_and_average_exactly():
    for dtype in (torch.float32, torch.bfloat16):
        for events, exact, cats, dtypes in run_distributed(_reduce, 2, dtype):
            starts = [i for i, e in enumerate(events) if e == "all_reduce start"]
            assert len(starts) == 4 and starts[0] < events.index("layer 0 backward begins"), events
            assert exact and cats == 0 and set(dtypes) == {dtype}
