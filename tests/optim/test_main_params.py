"""The distributed optimizer's float32 main params of 16-bit parameters (one data-parallel rank, so every element
is this rank's): each step is AdamW on a float32 copy with the float32 gradient, rounded into the bfloat16
parameter, bit for bit; weights loaded into a parameter between steps restart its copy."""

import torch
import torch.nn as nn

from lightning_seqpar.optim import DistributedOptimizer
from lightning_seqpar.parallel.mesh import ParallelMesh


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)


def _loss(model, step):
    torch.manual_seed(step)
    return model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()


def test_main_params_step_like_adamw_on_a_float32_copy():
    model, reference = _model(), _model()
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ParallelMesh.single(),
                                     main_params=True)
    main = [p.detach().float().clone().requires_grad_() for p in reference.parameters()]
    expected = torch.optim.AdamW(main, lr=1e-3)
    for step in range(3):
        with optimizer.buckets.reducing():
            _loss(model, step).backward()
        optimizer.finish_gradients()
        optimizer.step()
        optimizer.zero_grad()
        _loss(reference, step).backward()
        for m, p in zip(main, reference.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        expected.step()
        with torch.no_grad():
            for m, p in zip(main, reference.parameters()):
                p.copy_(m)
        for p, q, m in zip(model.parameters(), reference.parameters(), main):
            assert torch.equal(p, q)
            assert torch.equal(optimizer._pieces[id(p)].view(p.shape), m.detach())
    # a main copy is 4 bytes per element, AdamW's state 8, and a float32 step per parameter
    numel = sum(p.numel() for p in model.parameters())
    assert optimizer.state_bytes() == 4 * numel + 8 * numel + 4 * len(main)
    # the copies hold what bfloat16 cannot: after three steps of 1e-3 some differ from their rounded parameter
    assert any(not torch.equal(optimizer._pieces[id(p)].view(p.shape), p.float()) for p in model.parameters())


def test_weights_loaded_between_steps_restart_the_main_params():
    model = _model()
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), ParallelMesh.single(),
                                     main_params=True)
    loaded = [torch.full_like(p, 0.5) for p in model.parameters()]
    with torch.no_grad():
        for p, value in zip(model.parameters(), loaded):
            p.copy_(value)  # e.g. load_single_device_state_dict after setup
    with optimizer.buckets.reducing():
        _loss(model, 0).backward()
    optimizer.finish_gradients()
    optimizer.step()  # lr 0: the parameters keep the loaded values instead of the stale copies
    assert all(torch.equal(p, value) for p, value in zip(model.parameters(), loaded))
