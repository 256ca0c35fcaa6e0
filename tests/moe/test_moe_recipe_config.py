"""The recipes' expert-parallel strategy group and tiny mixture-of-experts model, as published: the composed
config builds SeqParallelStrategy(tp=2, ep=2) and a Qwen3-MoE whose experts it splits (the recipe's own module
builder, on the built-in corpus's vocabulary)."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_seqpar import SeqParallelStrategy, explain

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_the_recipe_strategy_group_splits_the_tiny_mixture_s_experts(capsys):
    from recipes.pretrain_gpt import build_module

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["model=qwen3_moe_tiny", "strategy=tp2_ep2"])
    strategy = SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
    assert (strategy.tp, strategy.layout.ep, strategy.layout.expert_tp) == (2, 2, 1)

    class Corpus:  # what build_module reads of the data module
        vocab_size = 256

    module = build_module(cfg, Corpus(), decay_steps=10, optim={})
    module.configure_model()
    plan = str(explain(module, tp=strategy.tp, ep=strategy.layout.ep))
    assert "8 experts (mlp.experts) → 4 per rank over ep=2" in plan


def test_the_reference_gpt_s_mixture_as_published_splits_its_experts(capsys):
    from recipes.pretrain_gpt import build_module

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["model=gpt_moe_tiny", "strategy=tp2_ep2"])

    class Corpus:
        vocab_size = 256

    module = build_module(cfg, Corpus(), decay_steps=10, optim={})
    assert module.gpt.config.output_router_logits  # the load-balancing loss is in the training loss
    plan = str(explain(module, tp=2, ep=2))
    assert "MLPs: 8 experts (mlp.experts) → 4 per rank over ep=2" in plan


def test_strategy_auto_takes_every_layout_key_the_other_groups_take():
    import pytest

    from lightning_seqpar.lightning.auto_layout import AutoLayout

    keys = lambda name: set(OmegaConf.load(CONF / "strategy" / f"{name}.yaml"))
    assert keys("pp2_tp2") == keys("auto")  # the same groups; under auto, layout.* bounds the planner's search
    with initialize_config_dir(str(CONF), version_base=None):
        overrides = ["model=qwen3_moe_tiny", "strategy=auto", "strategy.ep=2", "strategy.layout.zero=1",
                     "strategy.layout.memory_budget=2GB", "strategy.layout.schedules=[ZB-V]"]
        cfg = compose("config", overrides=overrides)
        strategy = SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
        assert isinstance(strategy.auto, AutoLayout) and strategy.auto.memory_budget == 2e9
        assert strategy.auto.schedules == ("ZB-V",) and strategy.auto.micro_batches == (1, 2, 4)
        assert (strategy.layout.ep, strategy.layout.zero, strategy.auto.zero) == (2, 1, 1)
        cfg = compose("config", overrides=["strategy=auto", "strategy.tp=2"])
    with pytest.raises(ValueError, match=r"chooses tp and pp; got tp=2, pp=1 as well: leave them out"):
        SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
