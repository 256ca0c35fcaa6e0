"""The planner prices LoRA and partly frozen full fine-tuning (``--lora R``, ``--frozen NAME``): the frozen base
holds its parameters only, the trained elements carry gradients and optimizer state. Checked against PEFT's own
count for Llama-3-8B at r 16 and against the byte formulas on the command line's records. The zero-bubble schedules are
not searched under LoRA: its frozen base leaves no weight gradient for W."""

from __future__ import annotations

import json

import pytest

from lightning_seqpar.plan import Hardware, model_inventory, plan
from lightning_seqpar.plan.__main__ import main
from tests.plan.test_planner import LLAMA3_8B, PUBLISHED

BASE = PUBLISHED["llama3-8b"][1]
# r·(in + out) per adapted projection, 32 layers: q, o 4096→4096; k, v 4096→1024; gate, up, down 4096↔14336
LORA_16 = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
EMBEDDINGS = 2 * 128256 * 4096  # embed_tokens and the untied lm_head


def test_lora_and_frozen_parts_are_counted_as_peft_and_torch_count_them():
    lora = model_inventory(LLAMA3_8B, lora=16)
    assert lora.num_trainable == LORA_16 == 41_943_040  # what PEFT prints for Llama-3-8B at r 16 on every projection
    assert lora.num_parameters == BASE + LORA_16
    frozen = model_inventory(LLAMA3_8B, frozen=("embed_tokens", "lm_head"))
    assert frozen.num_parameters == BASE and frozen.num_trainable == BASE - EMBEDDINGS


def _records(tmp_path, capsys, *flags):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--json", "--analytic",
                 "--cp", "1", "--precision", "32-true", *flags]) == 0
    records = json.loads(capsys.readouterr().out)
    return next(r for r in records if (r["tp"], r["pp"], r["zero"]) == (1, 1, 0) and r["bytes"])


TENSORS = 32 * 9 + 3  # a layer's 7 projections and 2 norms; the embedding, the final norm, the head


@pytest.mark.parametrize("flags, total, trained, tensors", [
    (("--lora", "16"), BASE + LORA_16, LORA_16, 32 * 7 * 2),  # an A and a B per adapted projection
    (("--frozen", "embed_tokens", "lm_head"), BASE, BASE - EMBEDDINGS, TENSORS - 2),
    ((), BASE, BASE, TENSORS)])
def test_the_command_line_prices_the_trained_elements_only(tmp_path, capsys, flags, total, trained, tensors):
    record = _records(tmp_path, capsys, *flags)  # float32 weights, gradients; AdamW's float32 moments and step
    assert record["bytes"]["parameters"] == 4 * total
    assert record["bytes"]["gradients"] == 4 * trained
    assert record["bytes"]["optimizer"] == 8 * trained + 4 * tensors


def test_the_header_says_what_is_trained(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic", "--cp", "1",
          "--top", "1", "--lora", "16"])
    assert "+ LoRA r=16: 8.07 B parameters (41.9 M trainable)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (("--lora", "16", "--frozen", "lm_head"), r"frozen=\['lm_head'\] with LoRA: LoRA trains the adapters only"),
    (("--lora", "16", "--lora-targets", "c_attn"), r"LoRA target_modules \['c_attn'\] match no module.*q_proj"),
    (("--frozen", "router"), "frozen 'router' names no parameter"),
    (("--lora", "0"), "--lora"),
])
def test_bad_fine_tuning_flags_are_refused_naming_the_value(tmp_path, capsys, flags, message):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic", *flags])
    assert exit.value.code == 2
    import re

    assert re.search(message, capsys.readouterr().err, re.S)


def test_zero_bubble_schedules_are_not_searched_where_lora_leaves_no_weight_gradient_to_defer():
    # The split backward defers the parallel linears' own weight gradients to W; LoRA freezes those weights (its
    # adapters' gradients stay in B), so W would fill no bubble and ZB-H1/ZB-V would be priced a bubble they lack.
    small = dict(LLAMA3_8B, num_hidden_layers=4)
    full, lora = model_inventory(small), model_inventory(small, lora=16)
    assert sum(e.deferred for e in full.entries) == 4 * 7 and not any(e.deferred for e in lora.entries)
    options = dict(hardware=Hardware(memory=1e12), calibrate=False, schedule=("1F1B", "ZB-H1", "ZB-V"))
    assert {"ZB-H1", "ZB-V"} <= {r.schedule for r in plan(full, 8, 2048, 16, **options) if r.feasible}
    records = plan(lora, 8, 2048, 16, **options)
    assert not {"ZB-H1", "ZB-V"} & {r.schedule for r in records if r.feasible}
    assert any(r.reason == f"schedule={s} with no trained weight to defer to W (the split layers' weights are frozen: "
                           f"LoRA's base), so W fills no bubble" for r in records for s in ("ZB-H1", "ZB-V"))
