"""What a mixture of experts cannot be trained with is refused before training, naming the part and the fix: the
router losses over a last pipeline stage without experts, router jitter noise, LoRA on the experts' parameters,
a mixture of another shape (PhiMoE's sampling router), experts that ep does not divide, an expert width that expert_tp
does not divide, tp without sequence parallelism; and explain() shows the experts per rank, the groups and the
dispatch."""

import pytest

from lightning_seqpar import explain
from tests.helpers.models import build


def test_explain_shows_the_experts_per_rank_the_groups_and_the_dispatch(capsys):
    text = str(explain(build("hf", family="qwen2_moe", labels=True), tp=2, ep=2))
    assert ("8 experts (mlp.experts) → 4 per rank over ep=2, whole on each rank, gradients averaged over expert data "
            "parallel; router mlp.gate (top-2) on each rank's s/t·b tokens (sequence-parallel, weight summed over tp); "
            "dispatch and combine by all-to-all over ep (dropless: one host read of the split sizes per layer call); shared "
            "expert mlp.shared_expert.gate_proj/mlp.shared_expert.up_proj column-parallel, "
            "mlp.shared_expert.down_proj row-parallel, gated by mlp.shared_expert_gate") in text


def test_explain_shows_each_experts_width_split_over_expert_tp():
    text = str(explain(build("hf", family="qwen3_moe", labels=True), tp=2, ep=2, expert_tp=2))
    assert ("8 experts (mlp.experts) → 4 per rank over ep=2, each expert's width split over expert_tp=2 (tokens sent "
            "to every slice, outputs summed), gradients averaged over expert data parallel") in text
    assert "dispatch and combine by all-to-all over etp·ep (dropless" in text


def test_explain_states_the_capacity_and_its_drop_policy():
    from lightning_seqpar import DispatchConfig

    text = str(explain(build("hf", family="qwen3_moe", labels=True), tp=2, ep=2, moe=DispatchConfig(1.25, "position")))
    assert ("dispatch and combine by all-to-all over ep (capacity ⌈1.25·n·k/E⌉ pairs per expert from each rank, the "
            "rest dropped by position, no host read)") in text


def test_router_losses_over_a_last_pipeline_stage_without_experts_are_refused_by_name():
    # The last stage's loss reads the statistics the earlier stages sent; without a mixture there it never would.
    from types import SimpleNamespace

    from lightning_seqpar.build import attach_router_losses
    from lightning_seqpar.pipeline_parallel.layout import StageLayout

    runtime = SimpleNamespace(layout=StageLayout(2, 1, (1, 1)))
    with pytest.raises(ValueError, match=r"The last pipeline stage holds layers 1\.\.1, none with a mixture of experts.*"
                                         r"output_router_logits=False"):
        attach_router_losses(build("hf", family="qwen3_moe", labels=True, aux=0.5), runtime, {0})
    assert attach_router_losses(build("hf", family="qwen3_moe", labels=True), runtime, {0}) is None  # no such loss


def test_router_jitter_noise_is_refused_by_name():
    module = build("hf", family="mixtral", labels=True)
    for layer in module.model.model.layers:
        layer.mlp.jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"does not implement router jitter noise \(router_jitter_noise=0.1; train "
                                         r"with 0\)"):
        explain(module, tp=2, ep=2)


def test_lora_on_the_experts_is_taken_and_a_merged_one_refused_by_name():
    from peft import LoraConfig, get_peft_model

    module = build("hf", family="qwen3_moe", labels=True)
    module.model = get_peft_model(module.model, LoraConfig(r=2, target_modules=["q_proj"],
                                                           target_parameters=["mlp.experts.gate_up_proj"]))
    said = str(explain(module, tp=2, ep=2))  # one packed projection adapted: taken (tests/moe/test_expert_lora*.py)
    assert "LoRA r=2 on gate_up_proj (each expert's A and B with it over ep)" in said
    module.model.base_model.model.model.layers[0].mlp.experts.merge()  # the experts' adapter alone
    with pytest.raises(ValueError, match=r"layers\.0 mlp\.experts: this LoRA adapter on the experts cannot be trained "
                                         r"under the strategy: its adapter is merged"):
        explain(module, tp=2, ep=2)


def test_lora_on_an_expert_tensor_other_than_the_packed_projections_is_refused_by_name():
    from peft import LoraConfig, get_peft_model

    module = build("hf", family="gpt_oss", labels=True)
    module.model = get_peft_model(module.model, LoraConfig(r=2, target_modules=["q_proj"],
                                                           target_parameters=["mlp.experts.gate_up_proj_bias"]))
    with pytest.raises(ValueError, match=r"layers\.0 mlp\.experts: .* it adapts 'gate_up_proj_bias'; only the packed "
                                         r"projections \['gate_up_proj', 'down_proj'\] take adapters"):
        explain(module, tp=2, ep=2)


def test_a_mixture_of_another_shape_is_refused_for_what_it_has():
    import transformers

    config = transformers.PhimoeConfig(vocab_size=13, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"PhimoeDecoderLayer: mixture of experts of \['router', 'experts'\] \(not a "
                                         r"router module `gate` or `router` .* a router that is an nn.Linear"):
        explain(model, tp=2, ep=2)


@pytest.mark.parametrize("layout, match", [
    (dict(tp=2, ep=3), r"model\.model\.layers\.0: 8 experts do not split over ep=3 ranks: choose ep among the divisors "
                       r"of 8"),
    (dict(tp=2, ep=2, sequence_parallel=False), r"a mixture of experts under tp=2 needs sequence parallelism .* set "
                                                r"sequence_parallel=True"),
    (dict(tp=2, expert_tp=3), r"model\.model\.layers\.0: An expert width of 8 does not split over expert_tp=3 ranks: "
                              r"choose expert_tp dividing it"),
])
def test_a_split_the_experts_do_not_admit_is_refused_with_the_numbers(layout, match):
    with pytest.raises(ValueError, match=match):
        explain(build("hf", family="qwen3_moe", labels=True), **layout)


def test_the_planner_refuses_a_router_that_does_not_say_its_top_k_by_name():
    from lightning_seqpar.plan.measuring.models import inventory_of_hf_model

    model = build("hf", family="qwen3_moe").model
    assert inventory_of_hf_model(model).experts.top_k == 2  # priced (tests/plan/test_planner_experts.py)
    for module in model.modules():
        if hasattr(module, "top_k"):
            module.top_k = None
    with pytest.raises(ValueError, match=r"the router at mlp\.gate has no integer `top_k`; the planner cannot count "
                                         r"the experts each token goes through\. Choose the layout yourself"):
        inventory_of_hf_model(model)




def test_more_experts_per_token_than_experts_is_refused_by_name_before_training():
    model = build("hf", family="qwen3_moe", labels=True)
    for module in model.modules():
        if hasattr(module, "top_k"):
            module.top_k = 9  # of 8 experts: torch.topk would fail on every rank with "selected index k out of range"
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0: the router chooses 9 experts per token of 8: "
                                         r"experts per token \(num_experts_per_tok\) must lie in 1\.\.8"):
        explain(model, tp=2)


def test_the_reference_gpt_refuses_more_experts_per_token_than_experts():
    from lightning_seqpar.models import GPTConfig

    with pytest.raises(ValueError, match=r"experts_per_token=5 with n_experts=4: each token is routed to 1\.\.4"):
        GPTConfig(n_experts=4, experts_per_token=5)
    assert GPTConfig(n_experts=4, experts_per_token=4).experts_per_token == 4


@pytest.mark.parametrize("extra, match", [
    ({}, r"a qwen3_moe mixture of experts needs its expert count \('num_local_experts' or 'num_experts'; "
         r"transformers would take 128\)"),
    ({"num_experts": 8, "num_experts_per_tok": 9}, r"num_experts_per_tok = 9 with num_local_experts = 8: each token is "
                                                   r"routed to 1\.\.8 experts"),
])
def test_the_planner_refuses_a_mixture_config_without_its_expert_count_or_with_too_many_per_token(extra, match):
    from lightning_seqpar.plan.measuring.models import check_sizes

    config = dict(model_type="qwen3_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    with pytest.raises(ValueError, match=match):
        check_sizes({**config, **extra}, "config.json")
    assert check_sizes({**config, "num_experts": 8, "num_experts_per_tok": 2}, "config.json")["num_experts"] == 8
