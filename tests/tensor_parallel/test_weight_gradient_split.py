"""The B/W split of the parallel linears (:mod:`lightning_seqpar.tensor_parallel.weight_gradients`): B then W give the
unsplit backward's gradients bit for bit (float64); W's FLOPs are the weight GEMM's only and B's the input GEMM's; the
collectives of B + W are the unsplit backward's, the all-gather moved into W; accumulation hooks fire at W; frozen
weights have no W; a whole rewritten model's step is unchanged. Tensor-parallel ranks are emulated by threads."""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.policies import rewrite
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore
from lightning_seqpar.transformer.context import RewriteContext

S, B, H, OUT = 8, 2, 12, 16
LAYOUTS = [(1, False), (2, False), (2, True)]  # (t, sequence parallel)
KINDS = ["column", "columns", "row"]
COLLECTIVES = ("all_gather", "all_gather_start", "reduce_scatter", "reduce_scatter_start", "all_reduce")


def _counting(group: ParallelGroup) -> collections.Counter:
    """Count ``group``'s collectives as its callers make them (instance attributes over its methods; a collective
    made of others, an all-gather started and waited for, counts once)."""
    counts: collections.Counter = collections.Counter()
    depth = [0]
    for name in COLLECTIVES:
        method = getattr(group, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            if depth[0] == 0:
                counts[_name] += 1
            depth[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(group, name, counted)
    return counts


def _full(kind: str) -> tuple[list[torch.nn.Linear], torch.Tensor, int]:
    """The single-device linears, the global input and the seed of the output weights, made once in the main thread
    (the emulated ranks are threads of one process: one global generator)."""
    torch.manual_seed(0)
    if kind == "row":
        return [torch.nn.Linear(OUT, H).double()], torch.randn(S, B, OUT, dtype=torch.float64), 2
    count = 1 if kind == "column" else 2
    return [torch.nn.Linear(H, OUT).double() for _ in range(count)], torch.randn(S, B, H, dtype=torch.float64), 2


def _layers(kind: str, fulls: list, group: ParallelGroup, sp: bool) -> list[torch.nn.Module]:
    if kind == "row":
        return [RowParallelLinear.from_linear(fulls[0], group, sequence_parallel=sp)]
    return [ColumnParallelLinear.from_linear(f, group, sequence_parallel=sp) for f in fulls]


def _input(kind: str, x: torch.Tensor, group: ParallelGroup, sp: bool) -> torch.Tensor:
    if kind == "row":  # [s, b, out/t]: this rank's features
        x = x.chunk(group.size, dim=-1)[group.rank]
    elif sp:  # [s/t, b, h]
        x = x.chunk(group.size, dim=0)[group.rank]
    return x.clone().requires_grad_(True)


def _forward(kind: str, layers: list, x: torch.Tensor, group: ParallelGroup, sp: bool, seed: int) -> torch.Tensor:
    outs = column_parallel_linears(x, layers, group, sp) if kind == "columns" else (layers[0](x),)
    generator = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype)).sum() for o in outs)


def _run(kind: str, t: int, sp: bool, split: bool, frozen: bool = False):
    fulls, full_x, seed = _full(kind)

    def rank(group: ParallelGroup):
        layers = _layers(kind, fulls, group, sp)
        params = [p for layer in layers for p in layer.parameters()]
        if frozen:
            for p in params:
                p.requires_grad_(False)
        store = WeightGradientStore() if split else None
        for layer in layers:
            layer.weight_gradients = store
        hooked = []
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad is not None))
        x = _input(kind, full_x, group, sp)
        loss = _forward(kind, layers, x, group, sp, seed + group.rank)
        counts = _counting(group)
        phases = {}
        with FlopCounterMode(display=False) as flops:
            if split:
                with store.deferring():
                    loss.backward()
            else:
                loss.backward()
        phases["B"] = (flops.get_total_flops(), dict(counts), [p.grad for p in params], sum(hooked))
        if split:
            counts.clear()
            with FlopCounterMode(display=False) as flops:
                ran = store.run()
            phases["W"] = (flops.get_total_flops(), dict(counts), ran, sum(hooked))
        return x.grad, [p.grad for p in params], phases

    return run_emulated(t, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, sp", LAYOUTS, ids=lambda v: str(v))
def test_b_then_w_equals_the_unsplit_backward_bit_for_bit(kind, t, sp):
    plain, split = _run(kind, t, sp, False), _run(kind, t, sp, True)
    for (x_grad, grads, _), (x_grad_split, grads_split, phases) in zip(plain, split):
        assert torch.equal(x_grad, x_grad_split)  # B alone gives the input gradient
        # no weight gradient in B (torch still calls the accumulation hooks there, with .grad unchanged: None); a
        # row-parallel bias, added after the reduction outside the split product, gets its gradient (a sum) in B
        in_b = phases["B"][2]
        assert all(g is None for g in in_b[0::2]) and phases["B"][3] == sum(g is not None for g in in_b)
        assert all(g is None for g in in_b[1::2]) == (kind != "row")
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_split)) and len(grads) == len(grads_split)
        assert phases["W"][3] == len(grads)  # every parameter's accumulation hook fired with its gradient, by W


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, sp", LAYOUTS, ids=lambda v: str(v))
def test_w_is_the_weight_gemm_and_the_collectives_only_move(kind, t, sp):
    plain, split = _run(kind, t, sp, False), _run(kind, t, sp, True)
    local_out = OUT // t
    m = S * B
    projections = 2 if kind == "columns" else 1
    if kind == "row":  # dY [m, h] · A [h, out/t] and dYᵀ · X [out/t]
        gemm = 2 * m * H * local_out
    else:  # dY [m, out/t] · A [out/t, h], per projection
        gemm = 2 * m * local_out * H * projections
    for (_, _, unsplit), (_, _, phases) in zip(plain, split):
        (b_flops, b_counts, _, _), (w_flops, w_counts, _, _) = phases["B"], phases["W"]
        assert (b_flops, w_flops, unsplit["B"][0]) == (gemm, gemm, 2 * gemm)
        # W re-gathers at once (nothing runs beside it to overlap): the unsplit backward's started all-gather
        expected = collections.Counter({("all_gather" if k == "all_gather_start" else k): v
                                        for k, v in unsplit["B"][1].items() if v})
        if t > 1:  # (at t = 1 the split runs the layers' functions, whose collectives are no-ops; F.linear has none)
            assert collections.Counter(b_counts) + collections.Counter(w_counts) == expected
        if kind != "row" and sp and t > 1:
            assert b_counts == {"reduce_scatter_start": 1} and w_counts == {"all_gather": 1}


def test_frozen_weights_have_no_w():
    for kind in KINDS:
        (x_grad, grads, phases), = _run(kind, 1, False, True, frozen=True)
        assert x_grad is not None and grads == [None] * len(grads) and phases["W"][2] == 0


def test_the_store_refuses_a_w_without_its_b_and_nested_bs():
    store = WeightGradientStore()
    with pytest.raises(RuntimeError, match="no weight gradient is pending"):
        store.run()
    with store.deferring(), pytest.raises(RuntimeError, match="entered twice"):
        with store.deferring():
            pass
    assert store.pending == 1 and store.run() == 0


def _gpt_grads(gpt: GPT, group: ParallelGroup, split: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    holder = torch.nn.Module()
    holder.gpt = copy.deepcopy(gpt)
    rewrite(holder, RewriteContext(group, group.size > 1, RNGTracker.for_tensor_parallel(0, group.rank),
                                   loss_parallel=True))
    model = holder.gpt
    store = WeightGradientStore()
    layers = split_weight_gradients(model, store if split else None)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(idx, idx)
    if split:
        with store.deferring():
            loss.backward()
        store.run()
    else:
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, layers


@pytest.mark.parametrize("t", [1, 2])
def test_a_rewritten_model_s_step_is_unchanged_by_the_split(t):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)).double()
    plain = run_emulated(t, lambda group: _gpt_grads(gpt, group, False))
    split = run_emulated(t, lambda group: _gpt_grads(gpt, group, True))
    for (loss, grads, _), (loss_split, grads_split, layers) in zip(plain, split):
        assert layers == 2 * 4 and loss == loss_split  # qkv, proj, fc1, fc2 per block (not the LM head)
        assert [n for n in grads if not torch.equal(grads[n], grads_split[n])] == []


def _lora_run(t: int, mode: str):
    """A tiny Llama with LoRA on all seven projections (PEFT's B drawn, so every adapter has a gradient), rewritten
    at t ranks with SP, one backward: (loss, trained gradients by name, B's and W's FLOPs, the adapters' W FLOPs as
    counted from their local shapes, gradients present after B). ``mode``: ``"plain"`` (no store: torch's linear),
    ``"inline"`` (the split layers' functions, each weight gradient computed in the backward) or ``"split"`` (B, then
    W)."""
    from tests.helpers.hf_models import HFCausalLM

    torch.manual_seed(0)
    module = HFCausalLM("llama", lora="all").double()
    s, b = 8, 2
    idx = torch.randint(0, 12, (b, s), generator=torch.Generator().manual_seed(1))

    def rank(group: ParallelGroup):
        holder = copy.deepcopy(module)
        rewrite(holder, RewriteContext(group, group.size > 1, RNGTracker.for_tensor_parallel(0, group.rank),
                                       loss_parallel=True), verify=False)
        store = WeightGradientStore()
        split_weight_gradients(holder, None if mode == "plain" else store)
        trained = {n: p for n, p in holder.named_parameters() if p.requires_grad}
        loss = holder.model(input_ids=idx, labels=idx).loss
        expected_w = 0
        for name, m in holder.named_modules():
            if hasattr(m, "weight_gradient_parameters") and "lora" not in name.rsplit(".", 1)[-1]:
                a, b_ = m.weight_gradient_parameters()
                sequence_local = isinstance(m.base_layer, ColumnParallelLinear) and group.size > 1
                expected_w += 2 * (s * b // (group.size if sequence_local else 1)) * a.numel() + 2 * s * b * b_.numel()
        with FlopCounterMode(display=False) as b_flops:
            with store.deferring() if mode == "split" else contextlib.nullcontext():
                loss.backward()
        after_b = sorted(n for n, p in trained.items() if p.grad is not None)
        with FlopCounterMode(display=False) as w_flops:
            if mode == "split":
                store.run()
        return (loss.item(), {n: p.grad for n, p in trained.items()}, b_flops.get_total_flops(),
                w_flops.get_total_flops(), expected_w, after_b)

    return run_emulated(t, rank)


@pytest.mark.parametrize("t", [1, 2])
def test_lora_adapters_defer_their_weight_gradients_to_w(t):
    """LoRA's A and B products split like the row-parallel product: B computes the input gradients (the frozen
    base's too), W only the adapters' weight GEMMs. B then W equals the same functions' unsplit backward bit for bit
    (float64), and torch's own linear within rounding: on the ``[s, b, h]`` views of a batch-first model torch
    multiplies batch by batch and sums, where the split product makes one GEMM of the flattened tokens."""
    runs = [_lora_run(t, mode) for mode in ("plain", "inline", "split")]
    for plain, inline, (loss, grads, b_flops, w_flops, expected_w, after_b) in zip(*runs):
        assert loss == inline[0] == plain[0] and len(grads) == 2 * 7 * 2  # A and B of 7 projections × 2 layers
        assert [n for n in grads if not torch.equal(grads[n], inline[1][n])] == []
        for name, g in grads.items():
            torch.testing.assert_close(g, plain[1][name], rtol=1e-12, atol=1e-15)
        assert after_b == []  # every trained weight is an adapter's: none has its gradient before W
        assert inline[5] == sorted(grads)  # unsplit: all of them after the backward
        assert w_flops == expected_w > 0 and b_flops + w_flops == inline[2] == plain[2]


def _micro_batches(kind: str, t: int, sp: bool, split: bool, engine: list, pre_hook: bool = False):
    """Two micro-batches' backwards accumulated (W after each B when ``split``): the input's and the parameters'
    gradients, the post-accumulate-grad hook calls per parameter (in W's when ``split``: torch calls them in B as
    well, with ``.grad`` unchanged), and how often the second W started autograd's engine (``engine`` counts the
    calls of ``torch.autograd.backward``). ``pre_hook``: a gradient hook on every weight, which doubles what it
    sees."""
    fulls, full_x, seed = _full(kind)

    def rank(group: ParallelGroup):
        layers = _layers(kind, fulls, group, sp)
        params = [p for layer in layers for p in layer.parameters()]
        store = WeightGradientStore() if split else None
        split_weight_gradients(torch.nn.ModuleList(layers), store)
        calls: collections.Counter = collections.Counter()
        counting = [not split]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: calls.update([i]) if counting[0] else None)
            if pre_hook and p.dim() == 2:
                p.register_hook(lambda g: None if g is None else 2 * g)
        x = _input(kind, full_x, group, sp)
        started = 0
        for micro_batch in range(2):
            loss = _forward(kind, layers, x, group, sp, seed + 10 * micro_batch + group.rank)
            with store.deferring() if split else contextlib.nullcontext():
                loss.backward()
            if split:
                counting[0], before = True, len(engine)
                store.run()
                counting[0], started = False, len(engine) - before
        deferred = [i for i, p in enumerate(params) if id(p) in (store.deferred if split else {id(p) for p in params})]
        return x.grad, [p.grad for p in params], {i: calls[i] for i in deferred}, started

    return run_emulated(t, rank)


@pytest.fixture
def engine(monkeypatch) -> list:
    """The calls of ``torch.autograd.backward`` made while the test runs."""
    calls: list = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (calls.append(a), backward(*a, **k))[1])
    return calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, sp", LAYOUTS, ids=lambda v: str(v))
def test_w_adds_into_the_gradient_without_the_engine(kind, t, sp, engine):
    """From the second micro-batch on, W adds its gradients into ``.grad`` in place as autograd's accumulation does
    (no engine started per projection) and calls the post-accumulate-grad hooks: bit for bit the unsplit backward's
    gradients (float64), each deferred parameter's hook called once per micro-batch, in W."""
    plain, split = _micro_batches(kind, t, sp, False, engine), _micro_batches(kind, t, sp, True, engine)
    weights = 2 if kind == "columns" else 1
    for (x_grad, grads, _, _), (x_grad_split, grads_split, calls, started) in zip(plain, split):
        assert torch.equal(x_grad, x_grad_split) and len(grads) == len(grads_split)
        assert [i for i, (a, b) in enumerate(zip(grads, grads_split)) if not torch.equal(a, b)] == []
        assert calls == {i: 2 for i in calls} and len(calls) == 2 * weights - (kind == "row") and started == 0


def test_a_weight_with_a_gradient_hook_accumulates_through_autograd(engine):
    """A hook that takes the gradient (``register_hook``) must see it before it is added: such a weight's W hands its
    gradient to autograd, which runs the hook; the result is the unsplit backward's with the hook."""
    for kind in KINDS:
        (_, plain, plain_calls, _), = _micro_batches(kind, 1, False, False, engine, pre_hook=True)
        (_, grads, calls, started), = _micro_batches(kind, 1, False, True, engine, pre_hook=True)
        assert [i for i, (a, b) in enumerate(zip(grads, plain)) if not torch.equal(a, b)] == []
        assert started == 1 and calls == {i: plain_calls[i] for i in calls} != {}
