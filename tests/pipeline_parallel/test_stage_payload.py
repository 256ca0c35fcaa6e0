"""What crosses pipeline stages beside the activations is a payload the executor only moves
(:mod:`lightning_seqpar.pipeline_parallel.payload`): a model that carries nothing has ``NoPayload``, a mixture's
router losses are one payload among any.

A two-stage pipeline of two linear layers carries a toy payload: stage 0 sends a vector beside each activation, the
last stage sends one back beside each gradient, and stage 0 back-propagates a term that reaches its own weight only.
The gradients must be one process's of the mean micro-batch loss plus that term, and every vector must arrive where,
and in the order, it was sent.
"""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_seqpar.moe.pipeline_losses import StageRouterLosses
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.pipeline_parallel import PipelineConfig, PipelineExecutor, StageRuntime, StageTransport
from lightning_seqpar.pipeline_parallel.payload import NoPayload, StagePayload
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

M, H, C = 3, 4, 0.25  # micro-batches, width, the back-propagated term's coefficient


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(StagePayload, name)) for name in vars(StagePayload)
            if not name.startswith("_") and callable(getattr(StagePayload, name))}


@pytest.mark.parametrize("payload", [NoPayload, StageRouterLosses])
def test_the_null_payload_and_the_router_losses_implement_the_protocol(payload):
    methods = _protocol_methods()
    assert set(methods) == {"forget", "forward_begins", "forward_sends", "forward_ends", "backward_sends",
                            "backward_share"}
    for name, signature in methods.items():
        assert list(inspect.signature(getattr(payload, name)).parameters) == list(signature.parameters), name


def test_the_executor_refuses_a_transport_built_for_another_payload():
    class _One(NoPayload):
        parts = 1

    class _Transport:
        parts, one_shape = 1, False

    runtime = StageRuntime(PipelineConfig.build(pp=2).layout(2))
    runtime.payload = _One()
    with pytest.raises(ValueError, match=r"1 beside each activation \(_One\): build it with parts=2"):
        PipelineExecutor(runtime, _Transport(), PipelineConfig.build(pp=2, num_microbatches=M))  # type: ignore


class _Toy(NoPayload):
    """Stage 0 sends ``[mb, 10·mb]`` beside each activation; the last stage sends ``[C·(mb+1), 0]`` back; stage 0's
    share is ``C·(mb+1)·‖W₀‖²`` of that micro-batch."""

    parts = 1

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight, self.received, self.returned = weight, [], []

    def forward_begins(self, stage, microbatch, received, device):
        self.received.append((stage, microbatch, [t.tolist() for t in received]))

    def forward_sends(self, stage, microbatch, training):
        return (torch.tensor([microbatch, 10.0 * microbatch], dtype=torch.float64),)

    def backward_sends(self, microbatch, device):
        return (torch.tensor([C * (microbatch + 1), 0.0], dtype=torch.float64),)  # the forward's shape

    def backward_share(self, stage, microbatch, received):
        self.returned.append((microbatch, received[0].tolist()))
        return received[0][0] * (self.weight ** 2).sum()


def _layers() -> tuple[nn.Linear, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    first, second = nn.Linear(H, H).double(), nn.Linear(H, H).double()
    return first, second, torch.randn(M, 2, H, dtype=torch.float64)


def _pipelined(rank, world_size):
    first, second, batches = _layers()
    layers = [first, second]
    config = PipelineConfig.build(pp=2, num_microbatches=M)
    runtime = StageRuntime(config.layout(2))
    runtime.payload = payload = _Toy(first.weight)
    executor = PipelineExecutor(runtime, StageTransport(ParallelGroup(dist.group.WORLD), torch.device("cpu"), 2),
                                config)

    def step(i):
        hidden = batches[i]
        for index, layer in enumerate(layers):
            hidden = runtime.layer(index, layer, hidden)
        return (hidden ** 2).mean()

    executor.run(step)
    grads = [layers[rank].weight.grad, layers[rank].bias.grad]
    return payload.received, payload.returned, grads


def test_a_payload_crosses_the_stages_and_its_share_has_one_process_gradient():
    (received_0, returned_0, grads_0), (received_1, returned_1, grads_1) = run_distributed(_pipelined, 2)
    assert received_0 == [(0, mb, []) for mb in range(M)]
    assert received_1 == [(1, mb, [[mb, 10.0 * mb]]) for mb in range(M)]
    assert sorted(returned_0) == [(mb, [C * (mb + 1), 0.0]) for mb in range(M)] and returned_1 == []

    first, second, batches = _layers()
    loss = sum((second(first(batches[i])) ** 2).mean() + C * (i + 1) * (first.weight ** 2).sum() for i in range(M)) / M
    loss.backward()
    for got, want in zip(grads_0 + grads_1, [first.weight.grad, first.bias.grad, second.weight.grad, second.bias.grad]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
