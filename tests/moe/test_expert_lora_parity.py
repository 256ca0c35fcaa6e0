"""LoRA on a mixture's experts (PEFT's ``target_parameters`` on the packed ``gate_up_proj`` and ``down_proj``) trains
like one process running PEFT under expert, expert tensor, tensor (+SP), pipeline (1F1B, ZB-H1 and ZB-V, whose W
takes the adapters' weight gradients) and data parallelism with the distributed optimizer: float64, the loss and every
adapter's gradient before each of 3 AdamW steps, the base frozen (no gradient anywhere else). Adapters drawn with
``init_lora_weights=False`` (B random), so A has a gradient from the first step.

Families: Qwen3-MoE, OLMoE, GLM-4.5 (a dense first layer, a shared expert); gpt-oss (``[E, h, 2f]`` weights, biases,
gate and up interleaved: its B split by contiguous slices over expert_tp); Mixtral with whole layers recomputed;
Qwen2-MoE's shared expert and its gate as ordinary LoRA linears beside the experts' (``all-linear`` and the experts, as
the fine-tuning module asks); and ``target_modules="all-linear"``, where PEFT also adapts the router's weight (the
router's adapters summed over tp like the router)."""

import dataclasses

import pytest

from tests.helpers.parity import assert_matches_single_process, all_cases, case_id, relative_error_below, world_runs
from tests.moe.test_moe_parity import GRAD_BOUND, LOSS_RTOL, moe

pytestmark = pytest.mark.distributed

CASES = {
    2: [
        moe("qwen3_moe", 2, 2, lora="experts"),                 # experts over the tp ranks, adapters with them
        moe("qwen3_moe", 2, 1, lora="experts", expert_tp=2),    # each expert's width over tp: A or B split
        moe("gpt_oss", 2, 2, lora="experts"),                   # [E, h, 2f], biases, interleaved gate/up
        moe("gpt_oss", 1, 1, lora="experts", expert_tp=2),      # the interleaved width over expert_tp (dp 2)
        moe("mixtral", 2, 2, "full", lora="experts"),           # whole layers recomputed
        moe("qwen3_moe", 2, 2, lora="all-linear"),              # + the router's weight, PEFT's choice
        moe("qwen2_moe", 2, 2, lora="all-linear+experts"),      # the shared expert and its gate beside the experts
        moe("olmoe", 2, 2, lora="experts"),
        moe("glm4_moe", 2, 2, lora="experts"),                  # a dense first layer, a shared expert, groups
    ],
    4: [
        moe("qwen3_moe", 2, 2, lora="experts", expert_tp=2),    # ep 2 × expert_tp 2
        moe("qwen3_moe", 1, 2, pp=2, lora="experts"),           # pp 2 × ep 2, 1F1B
        moe("qwen3_moe", 2, 2, zero=1, lora="experts"),         # ep 2 × dp 2, the distributed optimizer over edp
        dataclasses.replace(moe("qwen3_moe", 1, 2, pp=2, lora="experts"),  # ZB-H1: the adapters' W deferred
                            strategy=(("ep", 2), ("schedule", "ZB-H1"))),
        dataclasses.replace(moe("qwen3_moe", 1, 2, pp=2, lora="experts", layers=4),  # ZB-V: two chunks a rank
                            strategy=(("ep", 2), ("schedule", "ZB-V"))),
    ],
}

runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_expert_lora_matches_one_process_running_peft(runs, world_case):
    world_size, case = world_case
    per_rank = runs(world_size)
    assert_matches_single_process(per_rank, case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))
    grads = per_rank[0][case].grads[0]
    assert grads and all(".lora_A." in name or ".lora_B." in name for name in grads), sorted(grads)
    model = dict(case.model)
    if model["lora"] in ("experts", "all-linear+experts"):  # both packed projections of every mixture layer
        mixtures = model.get("layers", 2) - (model["family"] == "glm4_moe")  # GLM-4.5's first layer is dense
        assert sum(".experts." in name for name in grads) == 2 * 2 * mixtures, sorted(grads)
