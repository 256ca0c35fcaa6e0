"""``recipes/finetune.py objective=grpo``: LoRA on a chat model at tp 2, prompts rolled out in the training layout,
TRL's rollout metrics logged each step; a run resumed from its checkpoint continues bit-identically (each
completion's generator is seeded by the step and its prompt, nothing to restore); bad options refused first."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest

from tests.helpers.chat_tokenizer import make_chat_model_dir
from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

QUESTIONS = ["what is two plus two", "why is the sky blue", "tell me a joke", "good morning",
             "how are you", "say yes", "what is the sun", "good night"]
ANSWERS = ["four", "light", "no", "morning", "fine", "yes", "star", "moon"]
SETTINGS = ["objective=grpo", "peft=lora", "peft.r=2", "data.batch_size=2", "grpo.num_generations=4",
            "grpo.max_completion_length=6", "grpo.temperature=1.5", "trainer.val_check_interval=1",
            "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "sample.max_new_tokens=4"]


def _rows(directory) -> dict[str, dict[str, str]]:
    with next(directory.rglob("metrics.csv")).open(newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("reward")]
    return {r["step"]: r for r in rows}


def test_grpo_through_the_recipe_logs_trl_s_metrics_and_resumes_bit_identically(tmp_path):
    make_chat_model_dir(tmp_path / "model")
    records = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in zip(QUESTIONS, ANSWERS)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = [sys.executable, str(ROOT / "recipes" / "finetune.py"), f"model.pretrained={tmp_path / 'model'}",
              f"data.path={tmp_path / 'prompts.jsonl'}", *SETTINGS]
    run_job([*recipe, "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'straight'}"], tmp_path, timeout=600)
    straight = _rows(tmp_path / "straight")
    assert sorted(straight) == ["0", "1", "2"]
    for name in ("reward", "reward_std", "rewards/contains/mean", "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "train/loss", "clip_ratio/region_mean", "logps/rollout_mismatch_max",
                 "time/rollout_s", "time/update_s", "entropy"):
        assert name in straight["0"], name
    assert 0 < float(straight["0"]["completions/mean_length"]) <= 6
    assert float(straight["0"]["logps/rollout_mismatch_max"]) < 1e-4  # float32: the rollout's and training's forwards
    assert 0 < float(straight["0"]["entropy"]) <= math.log(41)  # nats: at most ln(v) over the tiny chat vocabulary
    run_job([*recipe, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'first'}"], tmp_path, timeout=600)
    checkpoint = next((tmp_path / "first").rglob("last.ckpt"))
    run_job([*recipe, "trainer.max_steps=3", f"ckpt_path={checkpoint}", f"hydra.run.dir={tmp_path / 'resumed'}"],
            tmp_path, timeout=600)
    resumed = _rows(tmp_path / "resumed")
    timeless = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    assert timeless(resumed["2"]) == timeless(straight["2"])  # the third step's rollouts, rewards, loss: every digit


def test_a_grpo_record_without_a_prompt_is_refused_naming_its_line(tmp_path):
    make_chat_model_dir(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"question": "hi", "answer": "no"}) + "\n")
    result = run_job([sys.executable, str(ROOT / "recipes" / "finetune.py"), f"model.pretrained={tmp_path / 'model'}",
                      f"data.path={tmp_path / 'prompts.jsonl'}", *SETTINGS, "trainer.max_steps=1",
                      f"hydra.run.dir={tmp_path / 'out'}"], tmp_path, timeout=600, check=False)
    assert result.returncode != 0
    assert "prompts.jsonl:1: a GRPO record is {\"prompt\": str | [messages], ...}" in result.stdout + result.stderr
