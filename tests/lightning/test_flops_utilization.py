"""``FlopsUtilization`` logs Eq. 7/8 FLOPs of the model it trains, per device and second."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from lightning_seqpar import ParallelMesh, RewriteContext, SeqParallelStrategy, apply_recompute, rewrite
from lightning_seqpar.lightning.callbacks import FlopsUtilization
from lightning_seqpar.memory import TransformerShape, model_flops_per_iteration
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker

S, B, H, A, L, V = 32, 2, 16, 4, 3, 50


def _module():
    root = nn.Module()
    root.gpt = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0), True))
    return root


def _trainer(tp, dp):
    """A trainer whose strategy has a (tp, dp) mesh, as after setup (no processes needed)."""
    strategy = SeqParallelStrategy(tp=tp)
    strategy._mesh = ParallelMesh({"tp": ParallelGroup.virtual(tp), "dp_cp": ParallelGroup.virtual(dp)})
    return SimpleNamespace(strategy=strategy, world_size=tp * dp)


@pytest.mark.parametrize("recompute,extra_per_layer", [
    ("none", 0), ("selective", 12 * B * 2 * S * S * H), ("full", None)])
def test_logged_flops_follow_equations_7_and_8(recompute, extra_per_layer):
    module = _module()
    apply_recompute(module, recompute)
    trainer = _trainer(tp=2, dp=2)
    batch = (torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long))
    figures = FlopsUtilization(peak_flops=1e12).measure(trainer, module, batch, seconds=0.5)
    shape = TransformerShape(s=S, b=B, h=H, a=A, L=L, v=V)
    model = model_flops_per_iteration(shape, 2 * B)  # global batch: b × dp
    if extra_per_layer is None:  # one more forward of every layer
        extra_per_layer = 2 * 2 * B * S * H * (4 * H + 2 * 4 * H) + 4 * 2 * B * S * S * H
    hardware = model + L * extra_per_layer
    assert figures["perf/tokens_per_s"] == 2 * B * S / 0.5
    assert figures["perf/model_tflops"] == pytest.approx(model / 0.5 / 4 / 1e12, rel=1e-12)
    assert figures["perf/hardware_tflops"] == pytest.approx(hardware / 0.5 / 4 / 1e12, rel=1e-12)
    assert figures["perf/mfu"] == pytest.approx(model / 0.5 / 4 / 1e12, rel=1e-12)
    assert figures["perf/hfu"] == pytest.approx(hardware / 0.5 / 4 / 1e12, rel=1e-12)


def test_no_peak_no_utilization_on_cpu():
    trainer = _trainer(tp=1, dp=1)
    figures = FlopsUtilization().measure(trainer, _module(), torch.zeros(B, S, dtype=torch.long), seconds=1.0)
    assert "perf/mfu" not in figures and figures["perf/model_tflops"] > 0


def test_on_cuda_batches_are_timed_with_events_and_never_waited_for(monkeypatch):
    """The CUDA path, with events standing in: reported once the device has passed a batch's end (``query``), never
    by waiting (no ``synchronize``), from the events' elapsed time."""
    class Event:
        made = []

        def __init__(self, enable_timing):
            self.done, self.at = False, None
            Event.made.append(self)

        def record(self):
            self.at = len(Event.made)

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return 250.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronized"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    callback = FlopsUtilization(peak_flops=1e12)
    module = _module()
    module.log_dict = lambda figures, **kwargs: None
    monkeypatch.setattr(type(module), "device", property(lambda self: torch.device("cuda")), raising=False)
    trainer = _trainer(tp=1, dp=1)
    batch = torch.zeros(B, S, dtype=torch.long)
    callback.on_train_batch_start(trainer, module, batch, 0)
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    assert callback.last == {}  # the device has not reached the batch's end yet
    Event.made[1].done = True
    callback.on_train_batch_start(trainer, module, batch, 1)
    callback.on_train_batch_end(trainer, module, None, batch, 1)
    assert callback.last["perf/tokens_per_s"] == B * S / 0.25


@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["tp1", "tp2-vocab-parallel"])
def test_llama_flops_count_grouped_query_attention_the_gated_mlp_and_the_vocabulary(vocab_parallel):
    """A Hugging Face Llama (4 query / 2 key-value heads, SwiGLU MLP of width 32, vocabulary 13), counted by hand."""
    from tests.helpers.models import build

    module = build("hf")
    tp = 2 if vocab_parallel else 1
    rewrite(module, RewriteContext(ParallelGroup.virtual(tp), False, RNGTracker.for_tensor_parallel(0, 0), True),
            verify=False)
    config = module.model.config
    h, a, g, f, v, L = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                        config.intermediate_size, config.vocab_size, config.num_hidden_layers)
    b, s = 2, 8
    per_layer = (2 * b * s * h * h          # q_proj
                 + 2 * 2 * b * s * h * (h // a * g)  # k_proj, v_proj: g heads of h/a
                 + 2 * b * s * h * h        # o_proj
                 + 3 * 2 * b * s * h * f    # gate_proj, up_proj, down_proj
                 + 2 * 2 * b * s * s * h)   # QKᵀ and attention over V
    expected = 3 * (L * per_layer + 2 * b * s * h * v)
    figures = FlopsUtilization().measure(_trainer(tp=tp, dp=1), module, torch.zeros(b, s, dtype=torch.long), seconds=1.0)
    assert figures["perf/model_tflops"] * 1e12 * tp == pytest.approx(expected, rel=1e-12)


def test_an_mlp_recomputed_by_module_adds_one_mlp_forward_per_layer():
    from lightning_seqpar.recompute import apply_recompute_modules

    module = _module()
    apply_recompute_modules(module, ["core_attn", "mlp"])
    batch = (torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long))
    figures = FlopsUtilization(peak_flops=1e12).measure(_trainer(tp=2, dp=2), module, batch, seconds=0.5)
    model = model_flops_per_iteration(TransformerShape(s=S, b=B, h=H, a=A, L=L, v=V), 2 * B)
    core_attention = 12 * 2 * B * S * S * H  # Eq. 8 as printed, per layer
    mlp = 2 * 2 * B * S * H * 4 * H * 2  # fc1 and fc2 of f = 4h, once more
    assert figures["perf/hardware_tflops"] == pytest.approx((model + L * (core_attention + mlp)) / 0.5 / 4 / 1e12,
                                                            rel=1e-12)
