"""Prefetch one layer ahead: when the backward first reads a copy of layer i, layer i − 1's copies come back, and no
earlier layer's; forwards of different micro-batches are never linked; training stays bit-identical; the step's peak
rises by at most one layer's offloaded bytes over reading each copy when its node asks for it."""

from __future__ import annotations

import weakref

import pytest
import torch

from lightning_seqpar.memory.peak import PeakMemoryTracker
from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES, HostPool, apply_offload
from lightning_seqpar.offload.host_pool import HostCopy
from tests.offload.test_offload_one_process import _gpt, _step

LAYERS = 4


class _Watched(HostPool):
    """A CPU pool that records, at every read, which layer the copy is from and which layers have copies back."""

    def __init__(self, prefetch: bool = True) -> None:
        super().__init__("cpu", prefetch)
        self.reads: list[tuple[int, set[int]]] = []
        self._made: list[weakref.ref] = []  # weakly: autograd alone decides when a copy goes

    @property
    def made(self) -> list[HostCopy]:
        return [c for c in (ref() for ref in self._made) if c is not None]

    def offload(self, t):
        copy = super().offload(t)
        self._made.append(weakref.ref(copy))
        return copy

    def reload(self, copy):
        back = {c.forward.index for c in self.made if c.back is not None and c.forward is not None}
        self.reads.append((copy.forward.index, back))
        return super().reload(copy)


@pytest.mark.parametrize("modules", [("mlp",), ("attn_norm", "core_attn"), DENSE_OFFLOAD_MODULES],
                         ids=lambda m: "+".join(m))
def test_each_layer_comes_back_when_the_backward_reaches_the_layer_after_it(modules):
    plain = _step(_gpt(layers=LAYERS))
    model, pool = _gpt(layers=LAYERS), _Watched()
    apply_offload(model, list(modules), pool)
    loss, grads, _ = _step(model, pool)
    assert loss == plain[0] and all(torch.equal(grads[n], plain[1][n]) for n in grads)
    per_layer = pool.copies_out // LAYERS
    assert pool.copies_out == LAYERS * per_layer and pool.bytes_in == pool.bytes_out and pool.held == 0
    # every layer but the last (the first the backward reaches) came back ahead of its reads
    assert pool.prefetched == (LAYERS - 1) * per_layer
    first_reads = {}
    for layer, back in pool.reads:
        first_reads.setdefault(layer, back)
        # while layer i's backward reads, copies are back for layers i and i - 1 only: one layer ahead, no more
        assert back <= {layer, layer - 1}, (layer, back)
    assert list(first_reads) == list(range(LAYERS - 1, -1, -1))
    # at layer i's first read, layer i - 1 was not back yet: the read is what fetched it
    assert all(layer - 1 not in back for layer, back in first_reads.items())


def test_two_forwards_before_their_backwards_are_not_linked():
    """Micro-batches whose forwards run back to back (a pipeline's warm-up, gradient accumulation): the first layer of
    the second forward follows the last of the first, and still nothing of the first comes back in the second's
    backward."""
    model, pool = _gpt(layers=LAYERS), _Watched()
    apply_offload(model, ["attn_norm", "mlp"], pool)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    first, second = model(idx, idx), model(idx.flip(0), idx.flip(0))
    made_first = len(pool.made) // 2
    kept_first = pool.made[:made_first]
    second.backward()
    assert [c.back for c in kept_first] == [None] * made_first
    del kept_first
    assert pool.bytes_in == pool.bytes_out // 2 and pool.prefetched == (LAYERS - 1) * made_first // LAYERS
    first.backward()
    assert pool.bytes_in == pool.bytes_out and pool.prefetched == 2 * (LAYERS - 1) * made_first // LAYERS


def test_without_prefetch_each_copy_comes_back_at_its_read_and_the_peak_is_one_layer_lower():
    def peak(prefetch: bool) -> tuple[int, int]:
        model, pool = _gpt(layers=LAYERS), HostPool("cpu", prefetch=prefetch)
        apply_offload(model, ["mlp"], pool)
        idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        model(idx, idx).backward()  # warm-up: cached masks are not the step's
        with PeakMemoryTracker() as tracker:
            tracker.hold(model.parameters(), [p.grad for p in model.parameters()])
            model(idx, idx).backward()
        return tracker.peak, pool.bytes_out // (2 * LAYERS)

    (on, layer_bytes), (off, _) = peak(True), peak(False)
    assert HostPool("cpu", prefetch=False).layer_forward(0, "mlp") is None
    assert off < on <= off + layer_bytes, (on, off, layer_bytes)


@pytest.mark.parametrize("layers, expected", [(1, 0.25), (2, 1.25), (3, 2 - 0.5), (8, 2 - 0.5)])
def test_the_planner_counts_the_prefetched_layer(layers, expected):
    """One layer's offload moved = 1, kept = 0.5, largest module share 0.25: the top layer's share and, from two layers
    on, the layer below it whole; from three on, a lower layer whole and the next one, less the top layer's kept."""
    from lightning_seqpar.plan.pricing.memory_choices import offload_backward_bytes

    assert offload_backward_bytes(1.0, 0.5, layers, 0.25) == expected
    assert offload_backward_bytes(1.0, 1.5, 3, 0.25) == 1.25  # the top layer's moment when it keeps more


def test_a_mixture_s_layers_each_come_back_one_layer_ahead_though_their_experts_regions_repeat():
    """The loop over experts enters the experts' regions once per expert: still one layer forward, so each layer's
    copies, the experts' included, come back when the backward reaches the layer after it."""
    from lightning_seqpar.models.gpt import GPT, GPTConfig
    from lightning_seqpar.parallel import ParallelGroup
    from lightning_seqpar.parallel.random import RNGTracker
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.transformer.context import RewriteContext
    from tests.offload.test_offload_one_process import _Root

    torch.manual_seed(0)
    root = _Root(GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=LAYERS, n_head=4, n_embd=32, dropout=0.0,
                               n_experts=4)))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0),
                                 loss_parallel=True))
    model, pool = root.gpt.double().train(), _Watched()
    apply_offload(model, ["attn_norm", "expert_fc1", "moe_act"], pool)
    _step(model, pool)
    per_layer = pool.copies_out // LAYERS
    assert pool.copies_out == LAYERS * per_layer and per_layer > 3  # the layer input, and each expert's regions
    assert pool.prefetched == (LAYERS - 1) * per_layer and pool.bytes_in == pool.bytes_out
    assert all(back <= {layer, layer - 1} for layer, back in pool.reads)
