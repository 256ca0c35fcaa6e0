"""Fine-tuning a pretrained Hugging Face model from the recipe, as the walk-through (docs/huggingface.md) says: the corpus
tokenized by the model's own tokenizer (a vocabulary above 65 535: uint32 cache), text out, and a directory that
``from_pretrained`` and ``AutoTokenizer`` load with the trained weights."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import numpy as np
import torch

from lightning_seqpar.checkpoint import consolidate
from lightning_seqpar.data.token_file import open_tokens
from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

TINY_RUN = {"trainer.max_steps": "4", "model.block_size": "32", "data.batch_size": "2",
            "trainer.val_check_interval": "2", "trainer.limit_val_batches": "2", "sample.max_new_tokens": "8",
            "trainer.log_every_n_steps": "1", "trainer.enable_progress_bar": "false"}


def walkthrough_commands() -> list[str]:
    """The ``python ...`` lines of the fine-tuning walk-through (docs/huggingface.md), as written."""
    readme = (ROOT / "docs" / "huggingface.md").read_text()
    block = re.search(r"<!-- walkthrough -->\n```bash\n(.*?)```\n<!-- /walkthrough -->", readme, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("python ")]


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    return run_job(args, cwd, timeout=600)


def _recipe_args(command: str, replace: dict[str, str]) -> list[str]:
    """The command's arguments with ``key=value`` overrides replaced (Hydra refuses a key given twice) and the
    tiny-run ones added."""
    args = shlex.split(command)
    keys = {a.split("=", 1)[0] for a in args if "=" in a}
    args = [f"{a.split('=', 1)[0]}={replace[a.split('=', 1)[0]]}" if "=" in a and a.split("=", 1)[0] in replace else a
            for a in args]
    return [sys.executable, *args[1:], *(f"{k}={v}" for k, v in replace.items() if k not in keys)]


def _sample(stdout: str) -> str:
    return stdout.split("--- sample ---")[1].split("--------------")[0].strip()


def test_the_readme_walkthrough_fine_tunes_on_json_lines_exports_and_generates(tmp_path, hf_model_dir):
    model_dir, text = hf_model_dir
    corpus = tmp_path / "corpus.jsonl"
    lines = text.splitlines()
    corpus.write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 20]), "id": i}) + "\n"
                              for i in range(0, 2000, 20)))
    train, export_cli, generate = walkthrough_commands()
    train = train.replace("path/to/model", str(model_dir)).replace("corpus.jsonl", str(corpus))
    train = train.replace("recipes/", f"{ROOT}/recipes/")  # the walk-through runs from the repository; outputs go to cwd
    result = _run(_recipe_args(train, TINY_RUN), tmp_path)

    sample = _sample(result.stdout)  # decoded text of the model's tokenizer, from sample.prompt ("The ")
    assert sample.startswith("The ") and not sample.startswith("[") and len(sample.split()) >= 3
    header, ids = open_tokens(next(tmp_path.glob("corpus.jsonl.*.tokens")))
    assert header.dtype == "uint32" and header.max_id > 65535 and header.tokenizer == "tiny-llama"
    assert int(ids.max()) == header.max_id and (ids == 0).sum() == 100  # one end-of-text token per record
    log = (tmp_path / "outputs" / "finetune" / "pretrain_gpt.log").read_text()
    assert "--- sample ---" in log and "Tokenized" in log and "final metrics" in log

    _run(shlex.split(export_cli.replace("python", sys.executable, 1)), tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "finetuned")
    assert len(tokenizer) == 66_000 and tokenizer("The bapo")["input_ids"] == AutoTokenizer.from_pretrained(
        model_dir)("The bapo")["input_ids"]
    reference = LlamaForCausalLM(exported.config)
    reference.load_state_dict(consolidate(tmp_path / "outputs" / "finetune" / "checkpoints" / "last.ckpt", "model."))
    pretrained = AutoModelForCausalLM.from_pretrained(model_dir)
    x = tokenizer(" ".join(lines[3000:3003]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = exported(x).logits
        assert torch.equal(logits, reference(x).logits)  # the trained weights, bit for bit
        assert not torch.equal(logits, pretrained(x).logits)  # and they did train
    from_checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned_from_checkpoint").state_dict()
    assert all(torch.equal(v, from_checkpoint[k]) for k, v in exported.state_dict().items())

    generated = _run(shlex.split(generate.replace("python", sys.executable, 1)), tmp_path).stdout.strip()
    assert generated.startswith("The ") and len(generated.split()) > 3


def test_a_folder_of_text_files_fine_tunes_at_tp_2_with_the_models_tokenizer(tmp_path, hf_model_dir):
    model_dir, text = hf_model_dir
    lines = text.splitlines()
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"part{i}.txt").write_text("\n".join(lines[i * 700:(i + 1) * 700]) + "\n")
    result = _run([sys.executable, str(ROOT / "recipes" / "pretrain_gpt.py"), "model=hf_pretrained",
                   f"model.pretrained={model_dir}", f"data.path={tmp_path / 'docs'}", f"hydra.run.dir={tmp_path / 'out'}",
                   "sample.prompt=The bapo", *(f"{k}={v}" for k, v in TINY_RUN.items())], tmp_path)
    assert _sample(result.stdout).startswith("The bapo")
    header, ids = open_tokens(tmp_path / "docs.tiny-llama.tokens")  # beside the folder, not inside it
    assert header.dtype == "uint32" and (ids == 0).sum() == 3 and header.source["files"] == 3
    console = result.stdout + result.stderr
    assert "Traceback" not in console and "WARNING" not in console and "Warning" not in console  # nothing to act on
    assert console.count("Parameters (whole model") == 1  # printed once: by rank 0, through one handler


def test_corpora_and_options_that_cannot_apply_are_refused_with_the_fix(tmp_path, hf_model_dir):
    """What the recipe's launching process checks before any rank starts (its options, then the corpus against the
    tokenizer), run as the recipe runs it on the composed config: each refusal names the fix."""
    from hydra import compose, initialize_config_dir

    from recipes.pretrain_gpt import CONF_DIR, check_options, data_module

    model_dir, _ = hf_model_dir

    def refused(*overrides: str) -> str:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("config", overrides=list(overrides))
        with pytest.raises((ValueError, FileExistsError)) as error:
            check_options(cfg, tmp_path / "out")
            data_module(cfg)
        return str(error.value)

    assert "empty_init=true has no effect with a Hugging Face model" in refused("model=llama_tiny", "empty_init=true")
    assert "export_hf=out needs a Hugging Face model" in refused("model=gpt_tiny", "export_hf=out")
    run_folder = f"The export destination {tmp_path / 'out'} must be kept"  # before training, not after it
    assert run_folder in refused("model=llama_tiny", f"export_hf={tmp_path / 'out'}")
    assert "must be kept" in refused("model=hf_pretrained", f"model.pretrained={model_dir}", f"export_hf={model_dir}")
    (tmp_path / "gpt2.bin").write_bytes(np.arange(3000, dtype=np.uint16).tobytes())
    out = refused("model=hf_pretrained", f"model.pretrained={model_dir}", f"data.path={tmp_path / 'gpt2.bin'}",
                  "data.tokenizer=null", "trainer.max_steps=1", "model.block_size=32")
    assert "holds uint16 ids, which cannot name a vocabulary of 66000 (the tokenizer tiny-llama's" in out
