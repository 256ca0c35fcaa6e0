"""One frozen memory policy per layer: recomputation and offload each replace their half of every layer's
``LayerMemory`` and keep the other's; every layer is checked before any is set, so a refusal (a module both recomputed
and offloaded, a compiled body, a part the layer lacks) names the layer and leaves the model as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_seqpar.memory.layer_memory import NO_MEMORY_POLICY, LayerMemory
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.offload import HostPool, apply_offload
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.policies import rewrite
from lightning_seqpar.recompute import apply_recompute, apply_recompute_modules, rewritten_layers
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention
from lightning_seqpar.transformer.roles import LayerDims, ParallelLayer


class _Root(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _gpt(**config) -> GPT:
    torch.manual_seed(0)
    root = _Root(GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=32, dropout=0.1, **config)))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0),
                                 loss_parallel=True))
    return root.model.train()


def _policies(model: torch.nn.Module) -> list[LayerMemory]:
    return [layer.memory for layer in rewritten_layers(model)]


def test_each_choice_replaces_its_half_of_the_policy_and_keeps_the_other():
    model = _gpt()
    assert _policies(model) == [NO_MEMORY_POLICY] * 3
    apply_recompute_modules(model, ["mlp", "layernorm"])
    assert _policies(model) == [LayerMemory(recompute=frozenset({"mlp", "layernorm"}))] * 3
    pool = HostPool("cpu")
    apply_offload(model, ["attn_proj"], pool)
    offload = rewritten_layers(model)[0].offload
    assert offload.names == {"attn_proj"} and offload.pool is pool
    assert _policies(model) == [LayerMemory(recompute=frozenset({"mlp", "layernorm"}), offload=offload)] * 3
    apply_recompute(model, "full", "block", 1)  # the first layer whole: what it offloads and recomputes is moot there
    first, *rest = _policies(model)
    assert first == LayerMemory(whole=True, checkpoints_itself=False, offload=offload)
    assert first.offloaded == frozenset() and first.recomputed == frozenset()
    assert rest == [LayerMemory(offload=offload)] * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.whole = False  # type: ignore[misc]
    apply_recompute(model, "selective")
    assert all(m.recompute == {"core_attn"} and m.offload is offload for m in _policies(model))
    assert all(m.recompute for m in model.modules() if isinstance(m, CoreAttention))  # the layer handed it on
    apply_offload(model, None, pool)
    apply_recompute(model, "none")
    assert _policies(model) == [NO_MEMORY_POLICY] * 3
    assert not any(m.recompute for m in model.modules() if isinstance(m, CoreAttention))


def test_a_mixture_s_parts_follow_its_layer_s_policy():
    model = _gpt(n_experts=4, experts_per_token=2)
    slots = [layer.mlp_slot for layer in rewritten_layers(model)]
    apply_recompute_modules(model, ["moe_act"])
    assert all(slot.experts.recompute_activation and not slot.recompute_shared for slot in slots)
    apply_recompute_modules(model, ["moe", "moe_act"])  # the whole mixture recomputed: nothing inside it is
    assert all(layer.recompute_mlp and not layer.mlp_slot.experts.recompute_activation
               for layer in rewritten_layers(model))
    apply_recompute(model, "none")
    apply_offload(model, ["expert_fc1"], HostPool("cpu"))
    assert all(slot.experts.offloading is not None for slot in slots)
    apply_offload(model, None, HostPool("cpu"))
    assert all(slot.experts.offloading is None for slot in slots)


def test_what_a_layer_cannot_run_is_refused_by_name_and_nothing_is_set():
    model = _gpt(n_experts=4, experts_per_token=2)
    before = _policies(model)
    with pytest.raises(ValueError, match=r"modules=\['mlp'\] offloads a dense MLP; .* has MoEPart"):
        apply_offload(model, ["attn_norm", "mlp"], HostPool("cpu"))
    dense = _gpt()
    rewritten_layers(dense)[2].compile_config = object()  # the last layer compiled: the first two are not set either
    with pytest.raises(ValueError, match=r"compiled blocks \(compile=True\)"):
        apply_offload(dense, ["attn_norm"], HostPool("cpu"))
    assert _policies(model) == before and _policies(dense) == [NO_MEMORY_POLICY] * 3

    class Plain(ParallelLayer):  # a policy's own layer, which enters no offload region
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

        def layer_dims(self) -> LayerDims:
            return LayerDims(8, 2, 32, 1, False)

    plain = torch.nn.Sequential(Plain())
    with pytest.raises(ValueError, match="Activation offload runs in the parallel blocks built from a BlockSpec; Pla"):
        apply_offload(plain, ["attn_norm"], HostPool("cpu"))
    with pytest.raises(ValueError, match="post-norm"):
        apply_recompute_modules(plain, ["layernorm"])
    assert apply_recompute(plain, "full") == 1 and plain[0].recompute_layer and plain[0].checkpointed_whole
