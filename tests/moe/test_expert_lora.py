"""LoRA on the packed experts, on one process (:mod:`lightning_seqpar.transformer.expert_lora`): the experts with their
adapters compute what PEFT's merged weights compute (``W_i + (α/r) B_i A_i``, A expert-major, B expert-minor), on the
loop (float64) and on the grouped GEMM (float32), in both weight layouts; under a split backward the adapters'
gradients arrive in W and equal the unsplit backward's; what the parallel experts do not train is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar.moe.expert_adapter import ExpertAdapter
from lightning_seqpar.moe.experts import GroupedExperts
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore
from lightning_seqpar.transformer.expert_lora import ExpertLoRA, ExpertLoRAParts, expert_adapters, experts_with_lora

E, H, FFN, R = 4, 16, 8, 4
SIZES = [3, 0, 5, 2]  # expert 1 gets no row
SCALING = 0.75


def _adapted_experts(dtype: torch.dtype, transposed: bool) -> tuple[GroupedExperts, nn.Module, dict]:
    """Experts with random weights and an adapter of rank R on each packed projection (PEFT's shapes), wrapped as the
    strategy wraps them; the one-device adapters by projection."""
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, FFN, dtype=dtype, transposed=transposed, bias=transposed)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    experts.requires_grad_(False)
    shapes = {"gate_up_proj": (H, 2 * FFN), "down_proj": (FFN, H)}  # (in, out)
    chain = [ExpertLoRAParts(name, "default", nn.Parameter(torch.randn(R * E, fan_in, dtype=dtype) * 0.3),
                             nn.Parameter(torch.randn(fan_out, R * E, dtype=dtype) * 0.3), R, SCALING)
             for name, (fan_in, fan_out) in shapes.items()]
    module: nn.Module = experts
    for parts in reversed(chain):
        module = ExpertLoRA(module, parts, nn.Parameter(parts.a.detach().clone()),
                            nn.Parameter(parts.b.detach().clone()), transposed)
    return experts, module, {parts.parameter_name: parts for parts in chain}


def _merged(experts: GroupedExperts, adapters: dict) -> GroupedExperts:
    """A copy of ``experts`` with PEFT's delta merged into each weight (``get_delta_weight``'s einsum)."""
    merged = copy.deepcopy(experts)
    with torch.no_grad():
        for name, parts in adapters.items():
            a = parts.a.reshape(E, R, -1)  # [E, r, in]
            b = parts.b.reshape(parts.b.shape[0], R, E)  # [out, r, E]
            pattern = "o r e, e r i -> e i o" if experts.transposed else "o r e, e r i -> e o i"
            getattr(merged, name).add_(torch.einsum(pattern, b, a) * SCALING)
    return merged


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_adapted_experts_compute_peft_s_merged_weights(dtype, transposed):
    experts, adapted, adapters = _adapted_experts(dtype, transposed)
    grouped = dtype == torch.float32 and hasattr(F, "grouped_mm")
    adapter_list = [m.adapter() for m in adapted.modules() if isinstance(m, ExpertLoRA)]
    assert experts._grouped(torch.zeros(1, H, dtype=dtype), adapter_list) == grouped
    rows = torch.randn(sum(SIZES), H, dtype=dtype)
    want = _merged(experts, adapters)(rows, SIZES)
    got = adapted(rows, SIZES)
    for module in adapted.modules():  # the merged export's delta is PEFT's too
        if isinstance(module, ExpertLoRA):
            merged = _merged(experts, {module.parameter_name: adapters[module.parameter_name]})
            delta = getattr(merged, module.parameter_name) - getattr(experts, module.parameter_name)
            torch.testing.assert_close(module.delta_weight().detach(), delta, rtol=1e-5, atol=1e-6)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tolerance)


def test_an_adapter_rank_the_grouped_gemm_cannot_stride_takes_the_loop():
    experts, _, _ = _adapted_experts(torch.float32, False)
    odd = ExpertAdapter("gate_up_proj", torch.zeros(3 * E, H), torch.zeros(2 * FFN, 3 * E), 3, 1.0)  # 12 bytes
    assert experts._grouped(torch.zeros(1, H), []) == hasattr(F, "grouped_mm")
    assert not experts._grouped(torch.zeros(1, H), [odd])


def test_a_disabled_adapter_leaves_the_base():
    experts, adapted, _ = _adapted_experts(torch.float64, False)
    rows = torch.randn(sum(SIZES), H, dtype=torch.float64)
    for module in adapted.modules():
        if isinstance(module, ExpertLoRA):
            module.adapter_enabled = False
    assert torch.equal(adapted(rows, SIZES), experts(rows, SIZES))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_adapters_weight_gradients_arrive_in_w(dtype):
    _, plain, _ = _adapted_experts(dtype, False)
    split = copy.deepcopy(plain)
    store = WeightGradientStore()
    assert split_weight_gradients(split, store) == 3  # the experts and the two adapters
    adapters = [p for n, p in split.named_parameters() if "lora_" in n]
    assert len(adapters) == 4 and {id(p) for p in adapters} <= store.deferred
    rows = torch.randn(sum(SIZES), H, dtype=dtype)
    grads = []
    for model, deferring in ((plain, False), (split, True)):
        x = rows.clone().requires_grad_()
        out = model(x, SIZES)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum()
        if deferring:
            with store.deferring("mb"):
                loss.backward()
            assert all(p.grad is None for p in adapters)  # W has not run
            store.run("mb")
        else:
            loss.backward()
        grads.append((x.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (want_rows, want), (got_rows, got) = grads
    assert got.keys() == want.keys() and len(want) == 4
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_rows, want_rows, **tolerance)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance)


def _peft_experts(**config):
    """The experts module of a tiny Qwen3-MoE's first layer, wrapped by PEFT with ``config``."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    config = dict(dict(r=2, target_modules=["q_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), **config)
    return peft.get_peft_model(model, peft.LoraConfig(**config))


def _experts_of(model) -> nn.Module:
    return model.base_model.model.model.layers[0].mlp.experts


def test_peft_s_nesting_is_read_outermost_first_and_sliced_with_the_experts():
    model = _peft_experts()
    found = _experts_of(model)
    chain = expert_adapters(found, "layer 0 mlp.experts")
    assert [c.parameter_name for c in chain] == [found.parameter_name, found.base_layer.parameter_name]
    assert {c.parameter_name for c in chain} == {"gate_up_proj", "down_proj"}
    local = GroupedExperts(4, 16, 8, expert_parallel=2)
    wrapped = experts_with_lora(local, found, ParallelGroup.virtual(2, rank=1), ParallelGroup(), "layer 0")
    assert {n for n, _ in wrapped.named_parameters()} == {n for n, _ in found.named_parameters()}  # PEFT's names
    for parts, module in zip(chain, (wrapped, wrapped.base_layer)):
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        # ep rank 1 of 2 holds experts 2 and 3: A's rows 2r..4r, and B's columns {2, 3} of each of r blocks of 4
        assert torch.equal(a, parts.a.detach()[4:8])
        assert torch.equal(b, parts.b.detach()[:, [2, 3, 6, 7]])


def test_what_the_parallel_experts_cannot_train_is_refused_by_name():
    peft = pytest.importorskip("peft")
    model = _peft_experts()
    model.merge_adapter()
    with pytest.raises(ValueError, match=r"layer 0 mlp.experts: .*merged"):
        expert_adapters(_experts_of(model), "layer 0 mlp.experts")
    model = _peft_experts()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.base_model.set_adapter(["default", "other"])
    with pytest.raises(ValueError, match=r"2 active adapters"):
        expert_adapters(_experts_of(model), "layer 0 mlp.experts")
