"""The sequence-parallel backward of a column-parallel linear overlaps its communication with its GEMMs, as
Megatron-LM does: the input's re-gather is in flight during the input-gradient GEMM, and the input gradient's
reduce-scatter during the weight-gradient GEMM. Shown by order (recorded), not by time; gradients stay exact."""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.tensor_parallel import ColumnParallelLinear
from lightning_seqpar.tensor_parallel.layers import column_parallel_linears
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _GemmEvents(TorchDispatchMode):
    """Notes every matrix product in the communication log's event list, between the collectives' events."""

    def __init__(self, log: CommunicationLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.log.event("gemm")
        return func(*args, **(kwargs or {}))


def _backward_order(rank, world_size, fused):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    s, b, h, out = 8, 2, 6, 10
    linears = [nn.Linear(h, out), nn.Linear(h, 4)]
    x = torch.randn(s, b, h, requires_grad=True)
    reference = sum(linear(x).pow(2).sum() for linear in (linears if fused else linears[:1]))
    reference.backward()

    group = ParallelGroup(torch.distributed.group.WORLD)
    parallel = [ColumnParallelLinear.from_linear(linear, group, sequence_parallel=True) for linear in linears]
    x_local = x.detach().chunk(world_size)[rank].clone().requires_grad_(True)
    outputs = column_parallel_linears(x_local, parallel, group, True) if fused else (parallel[0](x_local),)
    loss = sum(y.pow(2).sum() for y in outputs)
    group.log = CommunicationLog()
    with _GemmEvents(group.log):
        loss.backward()
    errors = [(x_local.grad - x.grad.chunk(world_size)[rank]).abs().max().item()]
    for p, linear in zip(parallel, linears if fused else linears[:1]):
        errors.append((p.spec.gather(p.weight.grad, group) - linear.weight.grad).abs().max().item())
    return group.log.events, max(errors)


def test_the_regather_and_the_reduce_scatter_run_during_the_gemms_and_gradients_are_exact():
    for fused, gemms in ((False, ["gemm"]), (True, ["gemm", "gemm"])):
        for events, error in run_distributed(_backward_order, 2, fused):
            assert error < 1e-12
            # input-gradient GEMM(s) while the re-gather is in flight; weight-gradient GEMM(s) while the input
            # gradient's reduce-scatter is
            assert events == ["all_gather start", *gemms, "reduce_scatter start", "all_gather wait", *gemms,
                              "reduce_scatter wait"], events
