"""Optional extras are asked for without importing them, and every command that needs one says which before any rank
starts; the reference GPT's path needs none."""

import configparser
import sys

import pytest
from hydra import compose, initialize_config_dir
from packaging.requirements import Requirement

from lightning_seqpar.extras import EXTRAS, has_extra, missing_modules, require_extra
from tests.package.test_versions import SETUP_CFG

IMPORT_NAMES = {"transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
                "peft": "peft", "math-verify": "math_verify"}


def _block(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, as where it was never installed


def test_the_extras_list_the_modules_setup_cfg_installs_for_them():
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    for extra, modules in EXTRAS.items():
        declared = {Requirement(line).name for line in config["options.extras_require"][extra].splitlines() if line}
        assert sorted(IMPORT_NAMES[name] for name in declared) == sorted(modules), extra


def test_a_missing_module_is_named_and_the_extra_refused_with_its_install_command(monkeypatch):
    assert has_extra("hf") and missing_modules("hf") == ()
    require_extra("hf", "anything")  # installed here: nothing to say
    _block(monkeypatch, "tokenizers")
    assert missing_modules("hf") == ("tokenizers",) and not has_extra("hf") and not has_extra("peft")
    with pytest.raises(ImportError) as error:
        require_extra("hf", "model=llama_tiny (a Hugging Face model)")
    assert str(error.value) == ("model=llama_tiny (a Hugging Face model) needs the [hf] extra (tokenizers not "
                                "installed): pip install -e '.[hf]' in a checkout, or pip install "
                                "'lightning_seqpar[hf]'.")
    with pytest.raises(KeyError, match="no extra 'lora'; the extras are hf, peft"):
        missing_modules("lora")


def _compose(name: str, *overrides: str):
    from recipes.pretrain_gpt import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=list(overrides))


def test_pretrain_options_needing_the_hf_extra_are_refused_before_any_rank_starts(monkeypatch, tmp_path):
    from recipes.pretrain_gpt import check_options

    _block(monkeypatch, "transformers", "safetensors", "tokenizers", "peft")
    check_options(_compose("config"), tmp_path / "out")  # the default job: the reference GPT on UTF-8 bytes
    check_options(_compose("config", "data.tokenizer=bytes"), tmp_path / "out")
    for overrides, needed_by in ((["model=llama_tiny"], "(a Hugging Face model)"),
                                 (["data.tokenizer=my_tokenizer"], "data.tokenizer=my_tokenizer"),
                                 (["strategy=auto"], "strategy=auto (the planner)"),
                                 (["strategy.tp=auto"], "strategy=auto (the planner)")):
        with pytest.raises(ImportError) as error:
            check_options(_compose("config", *overrides), tmp_path / "out")
        assert needed_by in str(error.value) and "[hf] extra" in str(error.value), overrides


def test_finetune_refuses_a_bare_install_and_lora_without_peft_before_any_rank_starts(monkeypatch, tmp_path):
    from recipes.finetune import check_options

    full = _compose("finetune", "model.pretrained=DIR", "data.path=chat.jsonl")
    lora = _compose("finetune", "model.pretrained=DIR", "data.path=chat.jsonl", "peft=lora")
    check_options(full, tmp_path / "out")
    check_options(lora, tmp_path / "out")
    _block(monkeypatch, "peft")
    check_options(full, tmp_path / "out")
    with pytest.raises(ImportError, match=r"peft=lora needs the \[peft\] extra \(peft not installed\)"):
        check_options(lora, tmp_path / "out")
    _block(monkeypatch, "transformers")
    with pytest.raises(ImportError, match=r"recipes/finetune.py \(a Hugging Face model\) needs the \[hf\] extra"):
        check_options(full, tmp_path / "out")


def test_planning_the_reference_gpt_without_transformers_names_the_extra(monkeypatch):
    from lightning_seqpar.lightning.auto_layout import planned_model
    from lightning_seqpar.models import GPTConfig, GPTLightningModule

    module = GPTLightningModule(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    assert planned_model(module).config.model_type == "gpt2"
    _block(monkeypatch, "transformers")
    with pytest.raises(ImportError, match=r"Planning GPTLightningModule \(priced as the Hugging Face gpt2 of its "
                                          r"sizes\) needs the \[hf\] extra \(transformers not installed\)"):
        planned_model(module)
