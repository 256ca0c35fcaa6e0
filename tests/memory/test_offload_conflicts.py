"""One table of what an offload cannot go with: the same answer from the memory model, the offload's budget plan, the
planner's rule and the check on a rewritten model (each used to keep its own list)."""

import pytest

from lightning_seqpar.memory.activations import TransformerShape, layer_activation_terms
from lightning_seqpar.memory.conflicts import OFFLOAD_CONFLICTS, offload_conflict, recomputed_modules
from lightning_seqpar.memory.mixture import MixtureShape
from lightning_seqpar.memory.conflicts import OFFLOAD_MODULES
from lightning_seqpar.offload.plan import plan_offload
from lightning_seqpar.plan.pricing.memory_choices import memory_choice_rule

SHAPE = TransformerShape(s=16, b=2, h=32, a=4, L=2, v=64)
EXPERTS = MixtureShape(num_experts=4, top_k=2, expert_ffn=16)
BY_MODULE = ("layernorm", "mlp", "moe", "moe_act")


def test_recomputed_modules_name_core_attention_only_where_it_is_explicit():
    assert recomputed_modules("selective", ("mlp",)) == {"core_attn", "mlp"}
    assert recomputed_modules("selective", (), cp=2) == set()  # blockwise attention keeps no s² tensor
    assert recomputed_modules("selective", (), eager_attention=False) == set()
    assert recomputed_modules("none", ("core_attn", "layernorm")) == {"core_attn", "layernorm"}
    assert recomputed_modules("none", ()) == set()


@pytest.mark.parametrize("recomputed", BY_MODULE + ("core_attn",))
def test_every_site_refuses_exactly_the_table_s_pairs(recomputed):
    """For each recomputed module and each single offloaded one: the table's answer, and the planner's rule, the
    memory model and the budget plan agree with it (a mixture's modules asked of a mixture, the MLP of a dense
    layer)."""
    mixture = recomputed in ("moe", "moe_act")
    recompute, modules = ("selective", ()) if recomputed == "core_attn" else ("none", (recomputed,))
    for module in OFFLOAD_MODULES:
        if (module == "mlp") == mixture and module in ("mlp", "expert_fc1", "moe_act"):
            continue  # a dense MLP in a mixture, or the experts in a dense layer: refused as such elsewhere
        conflict = offload_conflict([module], recomputed_modules(recompute, modules))
        expected = [c for c in OFFLOAD_CONFLICTS if c.recomputed == recomputed and module in c.offloaded]
        assert (conflict is not None) == bool(expected), (recomputed, module)
        rule = memory_choice_rule(recompute, modules, (module,), 1, True, mixture)
        assert rule == (None if conflict is None else conflict.message([module])), (recomputed, module)
        experts = EXPERTS if mixture else None
        if conflict is None:
            layer_activation_terms(SHAPE, recompute=recompute, modules=modules, offload=[module], experts=experts)
        else:
            with pytest.raises(ValueError, match=f"both recomputed \\({recomputed}\\) and offloaded"):
                layer_activation_terms(SHAPE, recompute=recompute, modules=modules, offload=[module], experts=experts)
    # the budget plan takes only modules the table allows, even where the budget needs all of them
    experts = EXPERTS if mixture else None
    names = [m for m in OFFLOAD_MODULES if (m in ("expert_fc1", "moe_act")) == mixture or m not in
             ("mlp", "expert_fc1", "moe_act")]
    allowed = [m for m in names if offload_conflict([m], recomputed_modules(recompute, modules)) is None]
    left = sum(layer_activation_terms(SHAPE, 1, True, recompute, modules=modules, offload=allowed, experts=experts,
                                      bytes_per_element=2, mask_bytes=1).values())
    plan = plan_offload(SHAPE, 1, True, 2 * left, layers=2, recompute=recompute, modules=modules, experts=experts)
    assert plan.modules and set(plan.modules) <= set(allowed) and plan.device_bytes <= 2 * left


def test_the_message_names_the_modules_the_recomputed_one_and_the_fix():
    conflict = offload_conflict(["mlp_norm", "attn_norm", "qkv_linear"], {"layernorm"})
    assert conflict.message({"mlp_norm", "attn_norm", "qkv_linear"}) == (
        "attn_norm, mlp_norm both recomputed (layernorm) and offloaded: the norms' outputs are rebuilt from their "
        "inputs, which stay on the device. Offload 'qkv_linear' or 'mlp' instead, or recompute without 'layernorm'.")
    assert offload_conflict(["qkv_linear"], {"layernorm", "mlp", "core_attn"}) is None
