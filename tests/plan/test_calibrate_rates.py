"""What ``calibrate`` measures on one device (no processes started): every time is the slowest rank's, and the
element-wise rates are solved from a Llama decoder layer at two sizes less its GEMMs' and attention's price."""

import pytest
import torch

from lightning_seqpar.plan.measuring import calibrate
from lightning_seqpar.plan.measuring.calibrate import SIZES, measure_device_rates
from lightning_seqpar.plan.measuring.calibrate_layer import LAYER_SIZES, PROJECTIONS, layer_step
from lightning_seqpar.plan.measuring.work import OperatorCounter

CPU = torch.device("cpu")


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_every_rate_is_the_slowest_rank_s_time():
    """Ranks measure at once, as training runs them (peers share the host's caches and bandwidth), and each time is
    the slowest rank's: every measurement passes through ``slowest`` once, and the rate is computed from what it
    returned, not from this rank's own time."""
    seen = []

    def slowest(seconds: float) -> float:  # a peer 1000x slower than this rank
        seen.append(seconds)
        return 1000 * seconds

    rates = measure_device_rates(CPU, 1, slowest)
    gemm_sizes, calls = SIZES["cpu"][:2]
    # GEMMs, attention calls, two layer sizes, the tiny one split, the optimizer
    assert len(seen) == len(gemm_sizes) + len(calls) + 4
    for (n, rate), seconds in zip(rates.gemm, seen):
        assert rate == pytest.approx(2 * n ** 3 / (1000 * seconds))
    assert rates.optimizer == pytest.approx(SIZES["cpu"][3] / (1000 * seen[-1]))
    tiny, split = seen[-4], seen[-2]
    assert rates.split == pytest.approx(max(0.0, 1000 * (split - tiny)) / PROJECTIONS)


def test_the_element_wise_rates_are_solved_from_a_decoder_layer_at_two_sizes():
    """A CPU whose layer times, less their GEMMs and attention, are ``operators × 7 µs + bytes / 30 GB/s``: the
    calibration recovers exactly those two rates from the layer's counted operators and bytes at its two sizes."""
    dispatch, memory = 7e-6, 3e10
    layers = []
    for size in LAYER_SIZES["cpu"]:
        step = layer_step(size, CPU, torch.float32)[0]
        step()
        counter = OperatorCounter()
        with counter:
            step()
        layers.append((counter.operators, counter.bytes, counter.operators * dispatch + counter.bytes / memory))
    assert layers[1][1] > 1000 * layers[0][1]  # the large layer's time is its bytes', the tiny one's its dispatch
    solved_memory, solved_dispatch = calibrate._elementwise_rates(CPU, layers)
    assert solved_dispatch == pytest.approx(dispatch, rel=1e-9) and solved_memory == pytest.approx(memory, rel=1e-9)


def test_the_split_layer_is_the_same_layer_with_its_projections_backward_split():
    """The split overhead is measured on the tiny layer run both ways: with a store, B leaves every one of its
    seven projections' weight gradients (and nothing else) to W, and B then W give the plain layer's gradients."""
    import copy

    from lightning_seqpar.plan.measuring.calibrate_layer import ReferenceLayer
    from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

    b, s, h, heads, f = LAYER_SIZES["cpu"][0]
    torch.manual_seed(0)
    plain = ReferenceLayer(h, heads, f).double()
    split = copy.deepcopy(plain)
    split.store = WeightGradientStore()
    x = torch.randn(b, s, h, dtype=torch.float64)
    inputs = (x, torch.ones(1, 1, s, h // heads, dtype=torch.float64), torch.zeros(1, 1, s, h // heads,
              dtype=torch.float64), torch.zeros(1, 1, s, s, dtype=torch.float64))
    plain(*inputs).square().sum().backward()
    with split.store.deferring():
        split(*inputs).square().sum().backward()
    waiting = [name for name, p in split.named_parameters() if p.grad is None]
    assert len(waiting) == PROJECTIONS and all("norms" not in name for name in waiting)
    assert split.store.run() == PROJECTIONS
    for (name, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_reference_layer_runs_a_hugging_face_llama_layer_s_operators(attention):
    """The calibration's layer stands for a model's: its operators forward and backward are within 7 % of a Hugging
    Face Llama decoder layer's (the same norms, rotary, SwiGLU; explicit attention as on CPU, the fused kernel as on
    CUDA), so its dispatch per operator is a model's. Measured: 240 against 250 explicit, 206 against 219 fused
    (transformers' rotary and SDPA wrapper add a few slices, copies and concatenations)."""
    import transformers

    b, s, h, heads, f = LAYER_SIZES["cpu"][0]
    x = torch.randint(0, 32, (b, s))

    def counted(step) -> int:
        step()
        counter = OperatorCounter()
        with counter:
            step()
        return counter.operators

    def model_operators(layers: int) -> int:
        config = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_attention_heads=heads,
                                          num_key_value_heads=heads, num_hidden_layers=layers, vocab_size=32,
                                          attn_implementation=attention)
        model = transformers.LlamaForCausalLM(config)
        return counted(lambda: model(input_ids=x, labels=x).loss.backward())

    llama_layer = model_operators(2) - model_operators(1)
    ours = counted(layer_step(LAYER_SIZES["cpu"][0], CPU, torch.float32, fused=attention == "sdpa")[0])
    assert abs(ours / llama_layer - 1) < 0.07, (ours, llama_layer)
