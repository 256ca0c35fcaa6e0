"""The fine-tuning walk-through (docs/finetuning.md) as written: LoRA on chat data at tp 2 from a pretrained chat
model's directory, validation loss and perplexity on supervised tokens, a reply, the PEFT adapter and the merged
model exported and loaded by PEFT and transformers; and full fine-tuning with the refusals that come first."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import shutil
import sys

import pytest
import torch

from tests.helpers.chat_tokenizer import make_chat_dir
from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

TINY = {"trainer.max_steps": "4", "trainer.val_check_interval": "2", "data.block_size": "64", "data.batch_size": "2",
        "sample.max_new_tokens": "6", "trainer.enable_progress_bar": "false"}


def walkthrough() -> list[str]:
    text = (ROOT / "docs" / "finetuning.md").read_text()
    block = re.search(r"<!-- walkthrough -->\n```bash\n(.*?)```\n<!-- /walkthrough -->", text, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("python ")]



def _run(args, cwd, check=True):
    return run_job(args, cwd, timeout=600, check=check, HYDRA_FULL_ERROR="1")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_dir(tmp_path_factory.mktemp("chat_recipe"), 120)


def test_the_walkthrough_trains_lora_on_chat_data_and_exports_what_peft_and_transformers_load(chat_dir, tmp_path):
    train, load_adapter, load_merged = (line.replace("path/to/model", str(chat_dir / "model"))
                                        .replace("chat.jsonl", str(chat_dir / "chat.jsonl")) for line in walkthrough())
    args = shlex.split(train.replace("recipes/", f"{ROOT}/recipes/"))
    result = _run([sys.executable, *args[1:], *(f"{k}={v}" for k, v in TINY.items())], tmp_path)
    log = (tmp_path / "outputs" / "lora" / "finetune.log").read_text()
    metrics = json.loads(re.search(r"final metrics: (\{.*\})", log).group(1).replace("'", '"'))
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-12) and metrics["val/loss"] > 0
    assert "--- sample ---" in log and "Traceback" not in result.stderr
    # What a user sees first: the layout with the predicted peak, PEFT's trainable line, the measured peak at the end.
    assert re.search(r"layout: Layout\(tp=2[^)]*\) dp=1 \(world 2, .*\); predicted peak per rank [\d.]+ GB", log)
    assert re.search(r"trainable params: [\d,]+ \|\| all params: [\d,]+ \|\| trainable%: [\d.]+", log)
    assert re.search(r"peak memory of rank 0: measured [\d.]+ GB \(peak RSS .*\) vs predicted [\d.]+ GB", log)
    metrics_csv = next((tmp_path / "outputs" / "lora").rglob("metrics.csv")).read_text().splitlines()
    header = metrics_csv[0].split(",")
    validated = [row.split(",")[header.index("step")] for row in metrics_csv[1:]
                 if row.split(",")[header.index("val/loss")]]
    assert len(validated) == len(set(validated)) == 2  # steps 2 and 4, the last one not validated again
    assert (tmp_path / "adapter" / "adapter_config.json").is_file() and (tmp_path / "merged" / "config.json").is_file()
    assert _run(shlex.split(load_adapter.replace("python", sys.executable, 1)), tmp_path).stdout.strip() == "16"
    parameters = int(_run(shlex.split(load_merged.replace("python", sys.executable, 1)), tmp_path).stdout.strip())
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(chat_dir / "model")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert parameters == base.num_parameters()  # the merged model is the base's shape: adapters folded in
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj")) for k in changed)  # only adapted projections moved


def test_full_fine_tuning_exports_the_whole_model_and_bad_options_are_refused_first(chat_dir, tmp_path):
    recipe = [sys.executable, str(ROOT / "recipes" / "finetune.py"), f"model.pretrained={chat_dir / 'model'}",
              f"data.path={chat_dir / 'chat.jsonl'}", f"hydra.run.dir={tmp_path / 'out'}"]
    from hydra import compose, initialize_config_dir

    from recipes.finetune import CONF_DIR, check_options

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):  # checked before any rank starts
        cfg = compose("finetune", overrides=[*recipe[2:-1], "export_hf_merged=m"])
    with pytest.raises(ValueError, match="export_hf_merged needs peft=lora"):
        check_options(cfg, tmp_path / "out")
    refused = _run([*recipe, "data.block_size=8"], tmp_path, check=False)
    assert refused.returncode != 0 and "longer than the block of 8" in refused.stderr + refused.stdout
    shown = dict(TINY, **{"trainer.enable_progress_bar": "true"})
    result = _run([*recipe, f"export_hf={tmp_path / 'full'}", *(f"{k}={v}" for k, v in shown.items())], tmp_path)
    assert "Epoch 0" in result.stdout + result.stderr and "/-2" not in result.stdout + result.stderr  # the bar
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    base = AutoModelForCausalLM.from_pretrained(chat_dir / "model")
    assert all(not torch.equal(v, base.state_dict()[k]) for k, v in full.state_dict().items() if v.dim() == 2)
    assert AutoTokenizer.from_pretrained(tmp_path / "full").chat_template  # the tokenizer, template included


def test_lora_on_a_mixture_s_experts_through_the_recipe(tmp_path):
    """``peft.target_modules=all-linear`` on a Qwen3-MoE at tp 2 × ep 2: the adapter the recipe exports targets the
    experts' packed weights and loads in PEFT with an adapter on every layer's experts; replies sampled while it trains
    (``sample.every_n_steps``) are logged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers.chat_tokenizer import chat_records, make_chat_model_dir

    make_chat_model_dir(tmp_path / "model", experts=4)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(40)))
    args = [f"{ROOT}/recipes/finetune.py", f"model.pretrained={tmp_path / 'model'}",
            f"data.path={tmp_path / 'chat.jsonl'}", "peft=lora", "peft.r=2", "peft.target_modules=all-linear",
            "strategy=tp2_ep2", f"export_hf={tmp_path / 'adapter'}", "sample.every_n_steps=2",
            *(f"{k}={v}" for k, v in TINY.items())]
    _run([sys.executable, *args], tmp_path)
    # replies generated in the training layout while it trained (experts over ep), at steps 2 and 4
    with next((tmp_path / "outputs").rglob("samples.csv")).open(newline="") as handle:
        samples = list(csv.reader(handle))
    assert samples[0] == ["step", "prompt", "reply"] and [row[0] for row in samples[1:]] == ["2", "4"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), tmp_path / "adapter")
    experts = [n for n, _ in loaded.named_parameters() if ".mlp.experts." in n and ".lora_B." in n]
    assert len(experts) == 2 * 2  # both packed weights of both layers
    # its checkpoint holds the adapters only and records its base: resumed on a copy of that base, it is refused
    checkpoint = next((tmp_path / "outputs").rglob("last.ckpt"))
    shutil.copytree(tmp_path / "model", tmp_path / "copy")
    resumed = [arg.replace(str(tmp_path / "model"), str(tmp_path / "copy")) for arg in args
               if not arg.startswith("export_hf=")] + [f"ckpt_path={checkpoint}", "trainer.max_steps=6"]
    refused = _run([sys.executable, *resumed], tmp_path, check=False)
    assert refused.returncode != 0
    assert "holds the trainable weights only; its frozen weights were read from" in refused.stdout + refused.stderr
