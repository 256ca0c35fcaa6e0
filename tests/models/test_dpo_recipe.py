"""The DPO walk-through (docs/finetuning.md) as written, on preference pairs whose chosen reply follows a rule the
rejected one breaks (tests/helpers/preference.py): LoRA at tp 2 with the recipe's default steps reaches a held-out
reward accuracy above 0.9 and exports its adapter; full fine-tuning at pp 2 × tp 2 computes the reference first,
caches it beside the data, and trains from it."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys

import pytest

from lightning_seqpar.models.dpo_reference import read_reference
from tests.helpers.chat_tokenizer import make_chat_model_dir
from tests.helpers.jobs import ROOT, run_job
from tests.helpers.preference import write_preferences

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def walkthrough() -> list[str]:
    text = (ROOT / "docs" / "finetuning.md").read_text()
    block = re.search(r"<!-- walkthrough-dpo -->\n```bash\n(.*?)```\n<!-- /walkthrough-dpo -->", text, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("python ")]


def _run(command: str, cwd, model, extra=()) -> dict:
    args = shlex.split(command.replace("path/to/model", str(model)).replace("recipes/", f"{ROOT}/recipes/"))
    run_job([sys.executable, *args[1:], "trainer.enable_progress_bar=false", *extra], cwd, timeout=600,
            HYDRA_FULL_ERROR="1")
    directory = re.search(r"hydra\.run\.dir=(\S+)", command).group(1)
    log = (cwd / directory / "finetune.log").read_text()
    return json.loads(re.search(r"final metrics: (\{.*\})", log).group(1).replace("'", '"')), log


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model_dir(tmp_path_factory.mktemp("dpo_recipe") / "model")


def test_lora_dpo_learns_the_rule_within_the_default_steps_and_exports_its_adapter(model, tmp_path):
    write_preferences(tmp_path / "pairs.jsonl", 120)
    lora, _ = walkthrough()
    metrics, log = _run(lora, tmp_path, model)
    assert metrics["val/rewards/accuracies"] > 0.9, metrics
    assert metrics["val/loss"] < math.log(2) and metrics["val/rewards/margins"] > 0
    assert "Traceback" not in log and "reference log-probabilities" not in log  # LoRA: the base, in the step
    config = json.loads((tmp_path / "dpo_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 16 and (tmp_path / "dpo_adapter" / "adapter_model.safetensors").is_file()


def test_full_dpo_at_pp2_tp2_trains_packed_pairs_from_a_reference_computed_first_and_cached(model, tmp_path):
    write_preferences(tmp_path / "pairs.jsonl", 40)
    _, full = walkthrough()
    tiny = ["trainer.max_steps=4", "trainer.val_check_interval=2", "data.block_size=64", "dpo.packing=true",
            "sample.max_new_tokens=4"]
    metrics, log = _run(full, tmp_path, model, tiny)
    assert re.search(r"layout: Layout\(tp=2, pp=2[^)]*\) dp=1", log)
    cache = next((tmp_path / "pairs.jsonl.dpo-reference").glob("*.json"))
    assert f"written to {cache}" in log
    values = read_reference(cache, None)
    assert values["training"].shape == (36, 2) and values["validation"].shape == (4, 2)
    assert (values["training"] < 0).all()  # log-probabilities of whole replies
    assert 0 < metrics["val/loss"] and set(metrics) >= {"rewards/chosen", "rewards/accuracies", "logps/rejected"}
