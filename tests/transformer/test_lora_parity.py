"""LoRA under tensor, sequence, pipeline and data parallelism trains like one process running PEFT: float64, the loss
every rank logs and every adapter's gradient over 3 AdamW steps, the LightningModule wrapping its model with
``get_peft_model(model, LoraConfig(...))`` as users do, adapters on all seven projections of Llama and Qwen3 (per-head
q/k norms). The frozen base has no gradient anywhere (the gradients compared are exactly the adapters').

Adapters are drawn with ``init_lora_weights=False`` (B random, not zeros) so that A has a gradient from the first
step; one case keeps PEFT's default (B = 0). Layouts: tp 2 with and without SP, tp 4, pp 2, pp 2 × tp 2, tp 2 × dp 2
with the distributed optimizer, selective and full recomputation; and under context parallelism (tp 2 × cp 2 ring;
cp 2 × dp 2 all-to-all with packed documents).
"""

import pytest

from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, relative_error_below, world_runs

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

LORA = (("labels", True), ("lora", "all"))
QWEN3 = LORA + (("family", "qwen3"),)

CASES = {
    2: [
        Case("hf", 2, True, None, LORA),                                    # tp 2, SP
        Case("hf", 2, False, None, LORA),                                   # tp 2, no SP
        Case("hf", 2, True, None, QWEN3),
        Case("hf", 2, False, "selective", QWEN3),
        Case("hf", 1, True, None, LORA, pp=2),                              # pp 2
        Case("hf", 2, True, "full", (("labels", True), ("lora", "default"))),  # PEFT's own init: B = 0
        Case("hf", 2, True, None, LORA + (("kv_heads", 4),), batch=8),      # for the adapters across tp
        Case("hf", 1, True, None, LORA, strategy=(("schedule", "ZB-H1"),), pp=2),  # ZB-H1: frozen bases have no W
        Case("hf", 1, True, None, LORA + (("layers", 4),), strategy=(("schedule", "ZB-V"),), pp=2),  # and ZB-V
        Case("hf", 1, True, None, LORA + (("layers", 4),), strategy=(("schedule", "DualPipeV"),), pp=2,
             batch=4),                                                      # and DualPipeV (m = 2p)
    ],
    4: [
        Case("hf", 4, True, None, LORA + (("kv_heads", 4),), batch=8),      # tp 4
        Case("hf", 4, True, None, QWEN3 + (("kv_heads", 4),)),
        Case("hf", 2, True, None, LORA, pp=2),                              # pp 2 × tp 2
        Case("hf", 2, True, None, QWEN3, pp=2),
        Case("hf", 2, True, None, LORA, strategy=(("zero", 1),)),           # tp 2 × dp 2, distributed optimizer
        Case("hf", 1, True, None, LORA + (("kv_heads", 4),), strategy=(("zero", 1),)),  # tp 1 × dp 4
        Case("hf", 2, True, None, LORA, cp=2),                              # tp 2 × cp 2 (ring)
        Case("hf", 1, True, None, LORA + (("documents", True),), strategy=(("cp_comm", "all_to_all"),), cp=2),
    ],
}
# As for the full models (tests/hf/test_hf_models.py): Hugging Face's norms and loss compute in float32 whatever the
# input's dtype, so float64 runs agree to float32 rounding; a missing reduction over t = 2 gives a relative error >= 0.5.
LOSS_RTOL, GRAD_BOUND = 1e-6, 1e-4


runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_lora_matches_one_process_running_peft(runs, world_case):
    world_size, case = world_case
    per_rank = runs(world_size)
    assert_matches_single_process(per_rank, case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))
    grads = per_rank[0][case].grads[0]
    assert grads and all(".lora_A." in name or ".lora_B." in name for name in grads), sorted(grads)
    layers = dict(case.model).get("layers", 2)
    assert len(grads) == 2 * 7 * layers  # A and B of seven projections in each layer, nothing of the frozen base


def test_adapters_trained_at_tp_1_2_and_4_are_the_same(runs):
    """The adapters are the one-device draw sliced, so training does not depend on t: the third step's gradients,
    taken at the adapters after two updates, agree across tp 1, 2 and 4: the same model and the same global batches
    (8 sequences: tp 1 × dp 4 with 2 each, tp 2 and tp 4 with all 8)."""
    runs2, runs4 = runs(2), runs(4)
    tp1 = runs4[0][CASES[4][5]].grads[-1]
    for records, case in ((runs2, CASES[2][6]), (runs4, CASES[4][0])):
        got = records[0][case].grads[-1]
        assert got.keys() == tp1.keys()
        wrong = {name: d for name in tp1 if (d := relative_error_below(GRAD_BOUND)(got[name], tp1[name]))}
        assert wrong == {}, (case, wrong)
