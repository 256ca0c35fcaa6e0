"""``Layout``: how the model is split and run as one value, the strategy's ``tp``/``pp``/``cp``/``ep`` its shorthands;
each field checked when the value is made, a layout the world cannot take refused in the Trainer's constructor, the
keywords that moved into it refused naming their new place, and experts split (``ep > 1``) over a model that has none
refused at setup."""

import inspect

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

from lightning_seqpar import (
    CheckpointConfig, DispatchConfig, LaunchConfig, Layout, PrecisionConfig, RewriteConfig, SeqParallelStrategy,
)
from lightning_seqpar.build import check_experts
from lightning_seqpar.lightning.strategy_arguments import MOVED
from lightning_seqpar.models import GPT, GPTConfig
from lightning_seqpar.parallel.placement import ShardSpec, place


def test_the_size_shorthands_fill_the_layout():
    given = SeqParallelStrategy(layout=Layout(tp=2, pp=2, cp=2, cp_comm="all_to_all", num_microbatches=4,
                                              sequence_parallel=False, loss_chunk=None))
    short = SeqParallelStrategy(tp=2, pp=2, cp=2, layout=Layout(cp_comm="all_to_all", num_microbatches=4,
                                                                 sequence_parallel=False, loss_chunk=None))
    assert short.layout == given.layout and (given.tp, given.pp, given.cp) == (2, 2, 2)
    assert SeqParallelStrategy(tp=2).layout == Layout(tp=2)
    assert SeqParallelStrategy(tp=2, layout=Layout(tp=2)).layout == Layout(tp=2)  # the same size twice: one value


def test_a_size_given_twice_with_two_values_is_refused():
    with pytest.raises(ValueError, match=r"tp=4 and layout.tp=2: give each size once"):
        SeqParallelStrategy(tp=4, layout=Layout(tp=2))


@pytest.mark.parametrize("keyword,value,where", [
    ("num_microbatches", 4, r"layout=Layout\(num_microbatches=...\) \(recipes: strategy.layout.num_microbatches\)"),
    ("schedule", "ZB-V", r"layout=Layout\(schedule=...\)"),
    ("zero", 1, r"layout=Layout\(zero=...\)"),
    ("parallel", None, r"layout=Layout\(...\)"),
    ("data_parallel", None, r"layout=Layout\(zero=..., fp32_main_params=...\)"),
    ("checkpoint_format", "full", r"checkpointing=CheckpointConfig\(format=...\)"),
    ("async_save", True, r"checkpointing=CheckpointConfig\(async_save=...\)"),
    ("low_precision_residual", True, r"precision_config=PrecisionConfig\(low_precision_residual=...\)"),
    ("policies", [], r"rewriting=RewriteConfig\(policies=\[...\]\)"),
    ("compile", True, r"rewriting=RewriteConfig\(compile=...\)"),
    ("timeout", 60, r"launch=LaunchConfig\(timeout=...\)"),
    ("process_group_backend", "gloo", r"launch=LaunchConfig\(backend=...\)"),
])
def test_a_keyword_that_moved_is_refused_naming_its_new_place(keyword, value, where):
    with pytest.raises(TypeError, match=f"{keyword}= is now {where}"):
        SeqParallelStrategy(tp=2, **{keyword: value})


def test_an_unknown_keyword_is_refused_by_name():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['tensor_parallel'\]"):
        SeqParallelStrategy(tensor_parallel=2)


def test_the_constructor_takes_at_most_16_parameters_and_every_old_keyword_has_a_new_place():
    parameters = [p for p in inspect.signature(SeqParallelStrategy.__init__).parameters if p != "self"]
    assert len(parameters) <= 16, parameters
    assert not set(MOVED) & set(parameters)


def test_each_settings_object_is_taken_as_a_mapping_as_recipes_give_it():
    strategy = SeqParallelStrategy(
        tp=2, pp=2, layout={"schedule": "gpipe", "moe": {"capacity_factor": 1.5}, "pipeline_split": [1, 3]},
        checkpointing={"format": "full"}, precision_config={"low_precision_residual": True},
        rewriting={"compile": {"backend": "aot_eager"}}, launch={"timeout": 60})
    assert strategy.layout == Layout(tp=2, pp=2, schedule="gpipe", moe=DispatchConfig(1.5), pipeline_split=(1, 3))
    assert strategy.checkpointer.config == CheckpointConfig(format="full")
    assert strategy.precision_config == PrecisionConfig(low_precision_residual=True)
    assert strategy.rewriting.compile.backend == "aot_eager" and strategy.launch.timeout.total_seconds() == 60
    with pytest.raises(ValueError, match=r"launch=\{'wait': 3\}: unknown key\(s\) \['wait'\]; LaunchConfig has"):
        SeqParallelStrategy(launch={"wait": 3})
    assert isinstance(SeqParallelStrategy(rewriting=RewriteConfig(verify=False)).rewriting, RewriteConfig)
    assert SeqParallelStrategy(launch=LaunchConfig(start_method="spawn")).launch.start_method == "spawn"


def test_a_layout_prints_as_python_and_as_recipe_overrides_that_give_it_back():
    layout = Layout(tp=2, pp=2, schedule="ZB-V", zero=1, moe=DispatchConfig(1.5), recompute="selective",
                    recompute_modules=("mlp",), offload=("attn_proj",), loss_chunk=None)
    assert eval(str(layout), {"Layout": Layout, "DispatchConfig": DispatchConfig}) == layout
    from hydra import compose, initialize_config_dir

    from recipes.pretrain_gpt import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["strategy=single", *layout.overrides().split()])
    from omegaconf import OmegaConf

    assert SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True)).layout == layout
    assert str(Layout()) == "Layout()" and Layout().overrides() == ""


@pytest.mark.parametrize("kwargs,match", [
    (dict(ep=0), "`ep` must be a positive integer, got 0"),
    (dict(expert_tp=1.5), "`expert_tp` must be a positive integer, got 1.5"),
    (dict(cp_comm="ulysses"), "cp_comm='ulysses'"),
    (dict(loss_chunk=0), "loss_chunk=0: a positive integer"),
    (dict(schedule="zb"), "schedule='zb': one of 1F1B"),
    (dict(zero=2), "zero=2: 0"),
    (dict(fp32_main_params=True), "fp32_main_params=True .* needs zero=1"),
    (dict(recompute="some"), "recompute='some': one of none, selective, full"),
    (dict(recompute_modules=("core_attn",)), r"recompute_modules=\('core_attn',\): \['core_attn'\] unknown"),
    (dict(offload=("everything",)), r"\['everything'\] unknown"),
    (dict(moe={"factor": 2}), r"unknown key\(s\) \['factor'\]"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_the_pipeline_s_fields_are_checked_together_before_any_rank_starts():
    with pytest.raises(ValueError, match="pipeline_split=\\[1, 1\\] must give 4 positive layer counts"):
        SeqParallelStrategy(pp=2, layout=Layout(virtual_stages=2, pipeline_split=(1, 1)))


def test_an_expert_grid_the_world_cannot_fold_is_refused_before_any_rank_starts(tmp_path):
    strategy = SeqParallelStrategy(tp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep·etp = 3·1 = 3 must divide tp·cp·dp = 4"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, default_root_dir=tmp_path)
    assert not torch.distributed.is_initialized()


def test_experts_split_over_a_model_without_experts_are_refused():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16))
    with pytest.raises(ValueError, match=r"ep=2 splits experts over ranks, and this model has none"):
        check_experts(model, 2)
    with pytest.raises(ValueError, match=r"expert_tp=2 splits experts over ranks, and this model has none.*leave ep=1 "
                                         r"and expert_tp=1"):
        check_experts(model, 1, 2)
    experts = nn.Parameter(torch.zeros(2, 4))
    place(experts, shard=ShardSpec(0, 4, 4), shard_over="ep", replicated_over="edp")
    model.register_parameter("experts", experts)
    check_experts(model, 2)  # a parameter split over ep: accepted
    check_experts(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)), 1)  # nothing to check


def test_expert_tp_must_fold_with_ep_over_the_dense_ranks(tmp_path):
    strategy = SeqParallelStrategy(tp=2, ep=2, layout=Layout(expert_tp=2))
    assert strategy.layout == Layout(tp=2, ep=2, expert_tp=2)
    with pytest.raises(ValueError, match=r"ep·etp = 2·2 = 4 must divide tp·cp·dp = 2"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path)
    assert not torch.distributed.is_initialized()


def test_the_planner_s_layout_goes_through_the_strategy_to_the_layout_report_unchanged():
    from types import SimpleNamespace

    from lightning_seqpar.lightning.callbacks.layout_report import LayoutReport
    from lightning_seqpar.plan import Hardware, model_inventory, plan

    config = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    records = plan(model_inventory(config), 8, 512, 16, hardware=Hardware(memory=1e12), calibrate=False,
                   schedule=("1F1B", "ZB-V"), memory_choices=True, precision="bf16-true")
    chosen = next(r for r in records if r.feasible and r.layout.pp > 1 and r.layout.zero)
    strategy = SeqParallelStrategy(layout=chosen.layout)
    trainer = SimpleNamespace(strategy=SimpleNamespace(layout=strategy.layout, mesh=None), world_size=8,
                              precision="bf16-true", callbacks=[])
    report = LayoutReport(seq_len=512, batch_size=2)
    report.on_fit_start(trainer, None)
    assert report.layout == strategy.layout == chosen.layout
    assert eval(str(report.layout), {"Layout": Layout, "DispatchConfig": DispatchConfig}) == chosen.layout
