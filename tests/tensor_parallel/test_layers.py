"""Parallel layers and operators against their single-device equivalents (float64, gloo)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.placement import set_shard_spec
from lightning_seqpar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _mlp_case(rank, world_size, sequence_parallel):
    """Column → GeLU → Row, the paper's Eq. 3, against nn.Linear; returns max errors."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    s, b, h, f = 8, 3, 6, 16
    fc1, fc2 = nn.Linear(h, f), nn.Linear(f, h)
    x = torch.randn(s, b, h, requires_grad=True)
    ref = fc2(F.gelu(fc1(x)))
    ref.pow(2).sum().backward()

    group = ParallelGroup(torch.distributed.group.WORLD)
    col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(fc2, group, sequence_parallel=sequence_parallel)
    x_local = x.detach().chunk(world_size)[rank].clone() if sequence_parallel else x.detach().clone()
    x_local.requires_grad_(True)
    out = row(F.gelu(col(x_local)))
    expected_out = ref.detach().chunk(world_size)[rank] if sequence_parallel else ref.detach()
    loss = out.pow(2).sum()
    if not sequence_parallel:
        loss = loss / world_size  # every rank holds the whole replicated output
    loss.backward()
    x_grad = x.grad.chunk(world_size)[rank] if sequence_parallel else x.grad
    bias_grad = row.bias.grad.clone()
    if sequence_parallel:  # the bias saw s/t tokens here: sum over the group, as the strategy does
        torch.distributed.all_reduce(bias_grad)
    else:
        torch.distributed.all_reduce(bias_grad)  # each rank holds 1/t of the loss
    return {
        "out": (out - expected_out).abs().max().item(),
        "x_grad": (x_local.grad * (1 if sequence_parallel else world_size) - x_grad).abs().max().item(),
        "col_weight": (col.spec.gather(col.weight.grad, group) * (1 if sequence_parallel else world_size)
                       - fc1.weight.grad).abs().max().item(),
        "row_weight": (row.spec.gather(row.weight.grad, group) * (1 if sequence_parallel else world_size)
                       - fc2.weight.grad).abs().max().item(),
        "row_bias": (bias_grad - fc2.bias.grad).abs().max().item(),
    }


def _frozen_case(rank, world_size):
    """What a column-parallel projection (alone, and two sharing one input) keeps for backward with its weights
    trained and frozen (LoRA's base), under SP; and the input and bias gradients of both, which must agree."""
    from lightning_seqpar.tensor_parallel.layers import column_parallel_linears

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    s, b, h, f = 8, 3, 6, 16
    group = ParallelGroup(torch.distributed.group.WORLD)
    x_full = torch.randn(s, b, h)
    out = {}
    for frozen in (False, True):
        torch.manual_seed(1)
        layers = [ColumnParallelLinear.from_linear(nn.Linear(h, f), group, sequence_parallel=True) for _ in range(2)]
        for layer in layers:
            layer.weight.requires_grad_(not frozen)
        x = x_full.chunk(world_size)[rank].clone().requires_grad_(True)
        kept: list = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
            y = layers[0](x) + sum(column_parallel_linears(x, layers, group, True))
        y.pow(2).sum().backward()
        out[frozen] = {"kept": kept, "x_grad": x.grad, "bias_grad": [layer.bias.grad for layer in layers]}
    return out


EMBEDDING_CASES = {2: [(10, 0.0, True), (7, 0.1, False)], 4: [(10, 0.1, True), (11, 0.2, False)]}


def _all_cases(rank, world_size):
    return {
        "mlp": {sp: _mlp_case(rank, world_size, sp) for sp in (True, False)},
        "operators": _operators_case(rank, world_size),
        "frozen": _frozen_case(rank, world_size),
        "embedding": {case: _embedding_and_loss_case(rank, world_size, *case) for case in EMBEDDING_CASES[world_size]},
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda t: f"tp{t}")
def results(request):
    return request.param, run_distributed(_all_cases, request.param)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_column_row_pair_matches_single_device(results, sequence_parallel):
    """Eq. 3: LayerNorm-free MLP under TP or TP+SP equals nn.Linear → GeLU → nn.Linear (float64)."""
    for rank_results in results[1]:
        errors = rank_results["mlp"][sequence_parallel]
        assert max(errors.values()) < 1e-12, errors


def _operators_case(rank, world_size):
    torch.set_default_dtype(torch.float64)
    group = ParallelGroup(torch.distributed.group.WORLD)
    full = torch.arange(4.0 * world_size * 2).view(4 * world_size, 2)
    local = full.chunk(world_size)[rank].clone().requires_grad_(True)
    # g: gather forward, reduce-scatter backward (each rank's upstream gradient is rank+1)
    gathered = gather_from_sequence_parallel_region(local, group)
    (gathered * (rank + 1)).sum().backward()
    g_ok = torch.equal(gathered.detach(), full) and torch.allclose(
        local.grad, torch.full_like(local, sum(range(1, world_size + 1)))
    )
    # ḡ: reduce-scatter forward, all-gather backward
    partial = (full * (rank + 1)).requires_grad_(True)
    scattered = reduce_scatter_to_sequence_parallel_region(partial, group)
    weight = torch.full_like(scattered, float(rank))
    (scattered * weight).sum().backward()
    expect_grad = torch.cat([torch.full_like(scattered, float(r)) for r in range(world_size)])
    gbar_ok = torch.allclose(scattered, full.chunk(world_size)[rank] * sum(range(1, world_size + 1))) and torch.equal(
        partial.grad, expect_grad
    )
    # scatter: split forward, all-gather backward
    replicated = full.clone().requires_grad_(True)
    part = scatter_to_sequence_parallel_region(replicated, group)
    (part * (rank + 1)).sum().backward()
    expect = torch.cat([torch.full_like(part, float(r + 1)) for r in range(world_size)])
    scatter_ok = torch.equal(part, full.chunk(world_size)[rank]) and torch.equal(replicated.grad, expect)
    return g_ok, gbar_ok, scatter_ok


def test_sequence_parallel_operators_forward_and_backward(results):
    """g, ḡ and scatter move the right data both ways."""
    for rank_results in results[1]:
        assert rank_results["operators"] == (True, True, True)


def _embedding_and_loss_case(rank, world_size, vocab, label_smoothing, sequence_parallel):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    b, s, h = 2, 4, 5
    emb = nn.Embedding(vocab, h)
    head = nn.Linear(h, vocab, bias=False)
    ids = torch.randint(0, vocab, (b, s))
    target = torch.randint(0, vocab, (b, s))
    target[0, 1] = -1  # ignored
    ref_loss = F.cross_entropy(head(emb(ids)).reshape(-1, vocab), target.reshape(-1), ignore_index=-1,
                               label_smoothing=label_smoothing)
    ref_loss.backward()

    group = ParallelGroup(torch.distributed.group.WORLD)
    pemb = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sequence_parallel)
    phead = ColumnParallelLinear(h, pemb.spec.padded_size, group, bias=False, sequence_parallel=sequence_parallel)
    phead.weight = torch.nn.Parameter(pemb.spec.shard(head.weight.detach(), group))
    set_shard_spec(phead.weight, pemb.spec)
    x = pemb(ids)  # [s/t, b, h] or [s, b, h]
    loss = vocab_parallel_cross_entropy(phead(x), target.t(), group, vocab, label_smoothing=label_smoothing,
                                        ignore_index=-1)
    loss.backward()
    return {
        "loss": abs(loss.item() - ref_loss.item()),
        "emb_grad": (pemb.spec.gather(pemb.weight.grad, group) - emb.weight.grad).abs().max().item(),
        "head_grad": (pemb.spec.gather(phead.weight.grad, group) - head.weight.grad).abs().max().item(),
        "padded": pemb.spec.padded_size,
    }


def test_vocab_parallel_embedding_and_cross_entropy_match_torch(results):
    """Padding (v not divisible by t) must not change the loss; label smoothing uses the global v."""
    world_size, per_rank = results
    for rank_results in per_rank:
        for (vocab, _, _), r in rank_results["embedding"].items():
            assert r["padded"] % world_size == 0 and r["padded"] >= vocab
            assert r["loss"] < 1e-12 and r["emb_grad"] < 1e-12 and r["head_grad"] < 1e-12, r


def test_a_frozen_column_parallel_weight_keeps_no_input_for_backward(results):
    """The input (its [s/t, b, h] shard under SP) is kept for the weight gradient only, as torch's own linear keeps it:
    a frozen base (LoRA's, or frozen layers) keeps its weights alone, and the input and bias gradients are unchanged."""
    world_size, per_rank = results
    s, b, h, f = 8, 3, 6, 16
    for rank in per_rank:
        trained, frozen = rank["frozen"][False], rank["frozen"][True]
        assert trained["kept"].count((s // world_size, b, h)) == 2  # the single projection's, the fused pair's
        assert (s // world_size, b, h) not in frozen["kept"]
        assert set(frozen["kept"]) == {(f // world_size, h)}  # the weights, for the input gradient
        assert torch.equal(frozen["x_grad"], trained["x_grad"])
        assert all(torch.equal(a, c) for a, c in zip(frozen["bias_grad"], trained["bias_grad"]))
