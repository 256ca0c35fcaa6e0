"""A parameter whose placement names groups other than data parallel, before any expert layer exists: a stand-in for
experts, split over a 2-rank expert-parallel group and replicated over expert data parallel, beside a dense weight
replicated over all 4 data-parallel ranks (dense grid dp 4; expert grid ep 2, edp 2: no expert group is a dense
one, so a consumer that reads the wrong group fails). Every consumer of the placement is checked against one process
in float64: finalization, the gradient buckets, the distributed optimizer's ranges and step, the gradient norm and
clipping, and a sharded checkpoint read back under two other expert layouts (ep 4 with zero=1, ep 1 with zero=0)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lightning_seqpar.parallel import ParallelDims
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

H, E, N = 4, 4, 3  # width, experts, tokens per rank
WORLD = 4
LAYOUT = ParallelDims(WORLD, ep=2, etp=1)  # dense: dp 4; experts: ep [[0, 1], [2, 3]], edp [[0, 2], [1, 3]]


class _Toy(nn.Module):
    """A dense projection, then the sum of this rank's experts' ``[h, h]`` matrices."""

    def __init__(self, dense: torch.Tensor, experts: torch.Tensor) -> None:
        super().__init__()
        self.dense = nn.Parameter(dense.clone())
        self.experts = nn.Parameter(experts.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ self.dense) @ self.experts.sum(0)).pow(2).mean()


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(H, H, generator=g, dtype=torch.float64), torch.randn(E, H, H, generator=g, dtype=torch.float64)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(N, H, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _spec():
    from lightning_seqpar.parallel.placement import ShardSpec

    return ShardSpec(dim=0, full_size=E, padded_size=E)


def _parallel(mesh, dense=None, experts=None):
    """This rank's toy model: the experts' rows of its expert-parallel rank, placed over ep / edp."""
    from lightning_seqpar.parallel.placement import place

    full_dense, full_experts = _weights()
    dense = full_dense if dense is None else dense
    experts = full_experts if experts is None else experts
    model = _Toy(dense, _spec().shard(experts, mesh.group("ep")))
    place(model.experts, shard=_spec(), shard_over="ep", replicated_over="edp")
    return model


def _reference(dims):
    """One process: the mean over ranks of each rank's loss on its batch and its experts."""
    dense, experts = _weights()
    model = _Toy(dense, experts)
    losses = []
    for r in range(WORLD):
        ep_rank = dims.group_of("ep", r).index(r)
        rows = experts.shape[0] // dims.size("ep")
        h = torch.tanh(_batch(r) @ model.dense)
        losses.append((h @ model.experts[ep_rank * rows:(ep_rank + 1) * rows].sum(0)).pow(2).mean())
    torch.stack(losses).mean().backward()
    return model


def _global(tensor, mesh, sharded):
    return _spec().gather(tensor, mesh.group("ep")) if sharded else tensor


def _global_state(optimizer, model, mesh):
    """``{"<param>.<key>": single-device tensor}`` of a (distributed) AdamW's state."""
    from lightning_seqpar.optim import DistributedOptimizer

    out = {}
    for name, p in model.named_parameters():
        if isinstance(optimizer, DistributedOptimizer):
            piece = optimizer._pieces[id(p)]
            state = {k: optimizer._gather_all(p, v) for k, v in optimizer.inner.state[piece].items() if v.dim()}
        else:
            state = {k: v for k, v in optimizer.state[p].items() if v.dim()}
        for key, value in state.items():
            out[f"{name}.{key}"] = _global(value, mesh, name == "experts")
    return out


def _consumers(rank, world_size, directory):
    from lightning_seqpar.checkpoint.safe_reader import read_metadata
    from lightning_seqpar.checkpoint.sharded import (
        MODEL_PREFIX, OPTIMIZER_PREFIX, hyperparameters, load_model, load_optimizer, model_entries, optimizer_entries,
        parameter_names,
    )
    from lightning_seqpar.optim import DistributedOptimizer
    from lightning_seqpar.optim.distributed_optimizer import optimizer_state_bytes
    from lightning_seqpar.optim.grad_buckets import gradient_buckets
    from lightning_seqpar.optim.gradients import clip_grad_norm_, finalize_gradients, grad_norm
    from lightning_seqpar.parallel import ParallelMesh

    dims = LAYOUT
    mesh = ParallelMesh.build(dims=dims)
    groups = {name: dims.group_of(name, rank) for name in ("dp_cp", "ep", "edp")}
    import torch.distributed as dist

    from lightning_seqpar.parallel.dims import GROUPS

    built = {name: (dist.get_process_group_ranks(mesh.group(name).group) if mesh.group(name).group is not None
                    else [rank]) for name in GROUPS}
    reference = _reference(dims)
    ref = {"dense": reference.dense.grad, "experts": reference.experts.grad}
    ref_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in ref.values()))
    out = {"groups": groups, "built": built, "expected": {name: dims.group_of(name, rank) for name in GROUPS},
           "representatives": {name: mesh.representative(name) for name in GROUPS}}

    def grads(model, of=lambda p: p.grad):
        return {n: _global(of(p), mesh, n == "experts").clone() for n, p in model.named_parameters()}

    # finalization, the norms and clipping (zero=0)
    model = _parallel(mesh)
    model(_batch(rank)).backward()
    finalize_gradients(model.parameters(), mesh)
    out["finalized"] = grads(model)
    out["norms"] = (float(grad_norm(model.parameters(), mesh)), float(grad_norm(model.parameters(), mesh, math.inf)))
    clip_grad_norm_(model.parameters(), ref_norm / 2, mesh)
    out["clipped"] = grads(model)

    # the buckets: one per replica group, reduced during backward
    model = _parallel(mesh)
    buckets = gradient_buckets(model, mesh, pipelined=False)
    out["bucket groups"] = sorted(b.group.size for b in buckets.buckets)
    with buckets.reducing():
        model(_batch(rank)).backward()
    finalize_gradients(model.parameters(), mesh, buckets.finish())
    out["bucketed"] = grads(model)
    buckets.remove()

    # zero=1: element ranges over each parameter's replicas, its norm, clipping and one AdamW step
    model = _parallel(mesh)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), mesh)
    with optimizer.buckets.reducing():
        model(_batch(rank)).backward()
    optimizer.finish_gradients()
    out["zero1 gradients"] = grads(model, optimizer.gathered_gradient)
    out["zero1 norm"] = float(optimizer.grad_norm())
    optimizer.clip_grad_norm_(ref_norm / 2)
    optimizer.step()
    out["zero1 ranges"] = {n: optimizer._ranges[id(p)] for n, p in model.named_parameters()}
    out["zero1 state bytes"] = optimizer_state_bytes(optimizer)
    out["zero1 weights"] = {n: _global(p.detach(), mesh, n == "experts") for n, p in model.named_parameters()}
    saved_state = _global_state(optimizer, model, mesh)

    # a sharded checkpoint of that state, read back under other expert layouts
    entries = {MODEL_PREFIX + k: v for k, v in model_entries(model, mesh.shard_device_mesh).items()}
    entries.update({f"{OPTIMIZER_PREFIX}0.state.{k}": v
                    for k, v in optimizer_entries(optimizer, parameter_names(model), mesh.shard_device_mesh).items()})
    import torch.distributed.checkpoint as dcp

    dcp.save(entries, checkpoint_id=directory)
    metadata = read_metadata(directory)
    out["resharded"] = {}
    for ep, zero in ((4, 1), (1, 0)):
        other = ParallelMesh.build(dims=ParallelDims(world_size, ep=ep, etp=1))
        fresh = _parallel(other, torch.zeros(H, H, dtype=torch.float64), torch.zeros(E, H, H, dtype=torch.float64))
        inner = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        loaded = DistributedOptimizer(inner, other) if zero else inner
        load_model(fresh, directory, metadata, other.shard_device_mesh, strict=True, allow_non_finite=False)
        load_optimizer(0, loaded, hyperparameters(loaded), parameter_names(fresh), directory, metadata,
                       other.shard_device_mesh, allow_non_finite=False)
        weights = {n: _spec().gather(p.detach(), other.group("ep")) if n == "experts" else p.detach()
                   for n, p in fresh.named_parameters()}
        out["resharded"][(ep, zero)] = (weights, _global_state(loaded, fresh, other))
    out["saved state"] = saved_state
    return out


def _reference_step():
    """One process: the gradients clipped to half their norm, then one AdamW step."""
    model = _reference(LAYOUT)
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    for p in model.parameters():
        p.grad.mul_(min(1.0, (norm / 2) / (norm + 1e-6)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_consumers, WORLD, str(tmp_path_factory.mktemp("experts")))


def _close(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-12, atol=1e-12, msg=key)


def test_the_mesh_builds_every_named_group_of_both_grids(ranks):
    for r in ranks:
        assert r["built"] == r["expected"]
        # one collective serves names of the same ranks (dp_cp is dp at c = 1); groups of one rank reduce nothing
        assert r["representatives"] == {"tp": None, "cp": None, "dp": "dp", "pp": None, "dp_cp": "dp", "etp": None,
                                        "ep": "ep", "edp": "edp", "etp_ep": "ep"}


def test_the_layout_folds_expert_groups_apart_from_the_dense_ones(ranks):
    assert [r["groups"] for r in ranks] == [
        {"dp_cp": [0, 1, 2, 3], "ep": [0, 1], "edp": [0, 2]}, {"dp_cp": [0, 1, 2, 3], "ep": [0, 1], "edp": [1, 3]},
        {"dp_cp": [0, 1, 2, 3], "ep": [2, 3], "edp": [0, 2]}, {"dp_cp": [0, 1, 2, 3], "ep": [2, 3], "edp": [1, 3]}]


def test_finalization_and_buckets_reduce_each_parameter_over_its_own_replicas(ranks):
    reference = _reference(LAYOUT)
    expected = {"dense": reference.dense.grad, "experts": reference.experts.grad}
    for r in ranks:
        _close(r["finalized"], expected)
        _close(r["bucketed"], expected)
        assert r["bucket groups"] == [2, 4]  # the experts' bucket over edp, the dense one over dp_cp


def test_norm_and_clipping_count_every_expert_shard_once(ranks):
    reference = _reference(LAYOUT)
    grads = [reference.dense.grad, reference.experts.grad]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    coef = min(1.0, (norm / 2) / (norm + 1e-6))
    for r in ranks:
        assert r["norms"][0] == pytest.approx(norm, rel=1e-12)
        assert r["norms"][1] == pytest.approx(max(float(g.abs().max()) for g in grads), rel=1e-12)
        assert r["zero1 norm"] == pytest.approx(norm, rel=1e-12)
        _close(r["clipped"], {"dense": grads[0] * coef, "experts": grads[1] * coef})


def test_zero1_splits_each_parameter_over_its_replicas_and_steps_like_one_process(ranks):
    reference = _reference(LAYOUT)
    model, _ = _reference_step()
    for rank, r in enumerate(ranks):
        _close(r["zero1 gradients"], {"dense": reference.dense.grad, "experts": reference.experts.grad})
        # dense: 16 elements over 4 replicas; experts: this rank's 2·4·4 = 32 over 2 (edp)
        edp_rank = r["groups"]["edp"].index(rank)
        assert r["zero1 ranges"] == {"dense": (4 * rank, 4 * rank + 4), "experts": (16 * edp_rank, 16 * edp_rank + 16)}
        assert r["zero1 state bytes"] == 2 * (4 + 16) * 8 + 2 * 4  # exp_avg, exp_avg_sq; a float32 step each
        _close(r["zero1 weights"], {"dense": model.dense.detach(), "experts": model.experts.detach()})


def test_a_checkpoint_of_expert_shards_reads_back_under_other_expert_layouts(ranks):
    model, optimizer = _reference_step()
    weights = {"dense": model.dense.detach(), "experts": model.experts.detach()}
    state = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in optimizer.state[p].items() if v.dim()}
    for r in ranks:
        _close(r["saved state"], state)
        for layout, (loaded_weights, loaded_state) in r["resharded"].items():
            _close(loaded_weights, weights)
            _close(loaded_state, state)
