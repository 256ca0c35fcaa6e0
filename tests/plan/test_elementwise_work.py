"""Element-wise work (``plan/measuring/work.py``): the counter counts exactly what it documents, the probes' fit scales
what a model's layer runs, and the planner prices it with the calibrated rates (a wrong dispatch time changes the
ranking)."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.plan import Hardware, model_inventory, plan
from lightning_seqpar.plan.measuring.calibration import COLLECTIVES, Link, StepCalibration
from lightning_seqpar.plan.measuring.work import OperatorCounter, count_step, fit_work
from lightning_seqpar.parallel.emulated import run_emulated

TINY_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False)


def test_the_counter_counts_each_operator_s_dispatch_and_the_bytes_it_reads_and_writes():
    a, b, m = torch.ones(10), torch.ones(10), torch.ones(4, 4)
    counter = OperatorCounter()
    with counter:
        c = a + b  # reads 2 × 40 bytes, writes 40
    assert (counter.operators, counter.bytes) == (1, 120)
    with counter:
        c.view(2, 5)  # a view: its dispatch only
        a.add_(b)  # in place: reads a and b, writes a
        torch.mm(m, m)  # a GEMM: its dispatch, its device time priced by its FLOPs
    assert (counter.operators, counter.bytes) == (4, 240)
    with counter, counter.paused():
        a.mul_(2)
    assert (counter.operators, counter.bytes) == (4, 240)


def test_a_backward_s_operators_are_counted_and_emulated_collectives_are_not():
    x = torch.ones(16, requires_grad=True)
    counter = OperatorCounter()
    with counter:
        (x * x).sum().backward()
    forward_only = OperatorCounter()
    with forward_only:
        (x * x).sum()
    assert counter.operators > forward_only.operators >= 2

    from lightning_seqpar.plan.measuring.work import _uncounted_collectives

    def one_rank(group):
        counter, x = OperatorCounter(), torch.ones(8)
        _uncounted_collectives(group, counter)
        with counter:
            group.all_gather(x)  # a cat of every thread's tensor, which a real backend does
        return counter.operators

    assert run_emulated(2, one_rank) == [0, 0]


@pytest.fixture(scope="module")
def llama():
    return model_inventory(TINY_LLAMA)


@pytest.fixture(scope="module")
def fits():
    """The probes' fits, shared by the cases (the planner's key: config, "work", tp, recompute, precision, ...)."""
    return {}


def _work_fit(llama, fits, tp, recompute):
    key = (llama.probe_key, "work", tp, recompute, "32-true", (), (), False)
    if key not in fits:
        fits[key] = fit_work(llama.config, tp, True, recompute, "32-true")
    return fits[key]


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_a_layer_s_work_is_the_difference_of_two_depths_and_the_fit_scales_it(llama, fits):
    config = llama.config
    fit = _work_fit(llama, fits, 1, "none")
    assert fit.check_error[0] < 0.02 and fit.check_error[1] < 0.05, fit.check_error
    # another size than the probes': the fit gives what a third and a second layer differ by
    s, b, d, f, v = 48, 2, 16, 96, 160
    overrides = dict(head_dim=d, hidden_size=4 * d, intermediate_size=f, vocab_size=v)
    three, two = (count_step(config, 1, True, "none", "32-true", s, b, overrides, layers=n) for n in (3, 2))
    operators, moved = fit.layer(s, b, d, f)
    assert operators == pytest.approx(three[0] - two[0], abs=2)  # a constant of the layout, but for a copy or two
    assert moved == pytest.approx(three[1] - two[1], rel=0.03)
    rest_operators, rest_moved = fit.rest(s, b, d, v)
    assert rest_operators == pytest.approx(three[0] - 3 * operators, abs=6) and rest_moved == pytest.approx(three[1] - 3 * moved, rel=0.05)
    # full recomputation runs each layer's forward again; tensor and sequence parallelism divide the bytes by t
    full = _work_fit(llama, fits, 1, "full")
    assert full.layer(s, b, d, f)[0] > operators and full.layer(s, b, d, f)[1] > moved
    halves = _work_fit(llama, fits, 2, "none").layer(s, b, d, f)[1] / moved
    assert 0.4 < halves < 0.6, halves


def _calibration(dispatch: float) -> StepCalibration:
    """GEMMs of 8 tokens' class at 1 TFLOP/s, larger ones slower (down to 0.1 at n = 8192): contrived, so that the
    compute alone prefers the smaller micro-batch. Measured on CPU: each operator's dispatch and bytes in its turn."""
    links = tuple((kind, n, Link(1e-5, 2e11)) for kind in COLLECTIVES for n in ((2,) if kind == "send_recv" else (2, 4)))
    return StepCalibration("cpu", "gloo", 4, ((8, 1e12), (8192, 1e11)), ((10 ** 6, 1e14), (10 ** 12, 3e14)), links,
                           1e10, 3e12, dispatch)


def test_the_planner_prices_the_work_and_a_slow_dispatch_prefers_fewer_micro_batches(llama, fits):
    kwargs = dict(context_parallel=(1,), micro_batches=(1, 8), fits=fits, precision="32-true")
    fast = plan(llama, 1, 1024, 8, hardware=Hardware(calibration=_calibration(1e-6)), **kwargs)
    slow = plan(llama, 1, 1024, 8, hardware=Hardware(calibration=_calibration(1e-2)), **kwargs)
    best = fast[0]
    assert best.step_time["elementwise"] > 0
    fit = fits[(llama.probe_key, "work", 1, best.layout.recompute, "32-true", (), (), False)]
    operators, moved = fit.layer(1024, best.micro_batch, llama.head_dim, llama.ffn_hidden_size)
    rest = fit.rest(1024, best.micro_batch, llama.head_dim, llama.vocab_size)
    m = best.layout.num_microbatches
    expected = m * (4 * operators + rest[0]) * 1e-6 + m * (4 * moved + rest[1]) / 3e12
    assert best.step_time["elementwise"] == pytest.approx(expected)
    # each micro-batch dispatches every operator once: at 10 ms an operator, one micro-batch of 8 wins over the 8
    # of 1 the compute prefers
    assert best.micro_batch == 1 and slow[0].micro_batch == 8, (best.micro_batch, slow[0].micro_batch)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "gpt2", "falcon"])
def test_every_probed_family_s_layer_is_counted_at_two_depths(family):
    """The families of the activation calibration (fused projections, four norms, learned positions, biases): a
    2-layer small copy builds and runs as the 3-layer one does, and a layer adds operators and bytes."""
    from tests.plan.test_activation_calibration import _config

    config = _config(family)
    three, two = (count_step(config, 2, True, "selective", "bf16-mixed", 16, 2, layers=n) for n in (3, 2))
    assert three[0] > two[0] > three[0] - two[0] > 0 and three[1] > two[1] > 0, (three, two)


def test_context_parallel_attention_s_own_work_is_counted_on_emulated_ranks_and_scaled():
    from lightning_seqpar.plan.measuring.work import count_context_attention, fit_context_work

    # the emulated ring passes each rank's tensor to the next, as the real one does
    received = run_emulated(3, lambda group: group.ring_exchange_start(torch.full((1,), float(group.rank))).wait())
    assert [int(x) for x in received] == [2, 0, 1]
    for fused in (True, False):  # SDPA's blocks (a Hugging Face model's default), or op by op (eager attention)
        two, four = (fit_context_work(c, "ring", 4, 2, 16, "32-true", fused) for c in (2, 4))
        assert four.operators > two.operators > two.forward_operators > 0  # c steps of merges and accumulators
        forward, backward = count_context_attention(2, "ring", 4, 2, 16, 3, 2 * 48, "32-true", fused)
        operators, moved = two.layer(48, 3, full=False)
        assert operators == forward[0] + backward[0]
        assert moved == pytest.approx(forward[1] + backward[1], rel=0.03)
        again = two.layer(48, 3, full=True)  # full recomputation: the forward once more
        assert again[0] == operators + forward[0] and again[1] == pytest.approx(moved + forward[1], rel=0.03)
