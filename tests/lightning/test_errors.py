"""Bad input fails early with an error naming the value and the fix."""


import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

from lightning_seqpar import (
    LaunchConfig, Layout, RewriteConfig, SelectiveRecompute, SeqParallelStrategy, explain, validate_layout,
)
from lightning_seqpar.models import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.transformer.region import enter_parallel_region


@pytest.mark.parametrize("world_size,tp,pp,match", [
    (6, 4, 1, "not divisible by tp·pp = 4·1"), (4, 0, 1, "`tp` must be a positive integer"),
    (4, 2, -1, "`pp` must be a positive integer"), (8, 3, 1, "Launch a multiple of 3"),
])
def test_layout_errors(world_size, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        validate_layout(world_size, tp, pp)


def test_world_size_not_divisible_fails_before_any_collective(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "0")  # this process is rank 0 of 3, launched externally
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a collective would hang or fail differently
    with pytest.raises(ValueError, match=r"world size \(3 processes\) is not divisible by tp·pp = 2·1"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=SeqParallelStrategy(tp=2), logger=False,
                   default_root_dir=tmp_path)  # in the Trainer's constructor: before any rank starts
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("config,match", [
    (dict(n_head=6, n_embd=24), "n_head = 6 is not divisible by the tensor-parallel size tp = 4"),
    (dict(n_head=4, n_embd=16, ffn_hidden_size=30), "ffn_hidden_size = 30 is not divisible"),
    (dict(n_head=4, n_embd=16, block_size=10), "sequence length 10 is not divisible by the tensor-parallel size 4"),
])
def test_gpt_shapes_that_cannot_be_split(config, match):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(GPTConfig(**config))

    with pytest.raises(ValueError, match=match):
        explain(LM(), tp=4)


def test_encoder_shapes_that_cannot_be_split():
    layer = nn.TransformerEncoderLayer(12, 3, 24)
    with pytest.raises(ValueError, match=r"0: nhead = 3 is not divisible by the tensor-parallel size tp = 2"):
        explain(nn.ModuleList([layer]), tp=2)
    layer = nn.TransformerEncoderLayer(12, 4, 30)
    with pytest.raises(ValueError, match="dim_feedforward = 30 is not divisible"):
        explain(nn.ModuleList([layer]), tp=4)


def test_unknown_model_names_the_classes_found_and_how_to_register_a_policy():
    class MyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([MyBlock()])

    with pytest.raises(ValueError, match=r"Block-like classes found \(in layer lists, or holding projections\), and why none is known: "
                                         r"MyBlock: not a known layout\..*BlockSpec.*Policy"):
        explain(MyModel(), tp=2)


def test_sequence_length_not_divisible_under_sp_fails_before_communicating():
    group = ParallelGroup.virtual(4)  # a virtual group raises if anything tries to communicate
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by the tensor-parallel size 4"):
        enter_parallel_region(torch.zeros(2, 6, 8), group, sequence_parallel=True, batch_first=True)


def test_recompute_arguments():
    with pytest.raises(ValueError, match="granularity"):
        SelectiveRecompute(granularity="partial")
    with pytest.raises(ValueError, match="method"):
        SelectiveRecompute(granularity="full", method="random")
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        SelectiveRecompute(granularity="full", num_layers=0)


def test_strategy_is_registered_by_name():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="seq_parallel", logger=False)
    assert isinstance(trainer.strategy, SeqParallelStrategy) and trainer.strategy.tp == 1


def test_registered_names_carry_their_tensor_parallel_size():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="seq_parallel_tp2", logger=False)
    assert isinstance(trainer.strategy, SeqParallelStrategy) and trainer.strategy.tp == 2


@pytest.mark.parametrize("timeout", [0, -5, "60"])
def test_bad_timeouts(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds or a datetime.timedelta"):
        SeqParallelStrategy(launch=LaunchConfig(timeout=timeout))


def test_zero1_refuses_an_optimizer_that_is_not_elementwise():
    from lightning_seqpar.optim import DistributedOptimizer
    from lightning_seqpar.parallel.mesh import ParallelMesh

    params = [torch.nn.Parameter(torch.ones(4, 4))]
    with pytest.raises(ValueError, match=r"Adafactor is not one of them\. Use zero=0"):
        DistributedOptimizer(torch.optim.Adafactor(params), ParallelMesh.single())
    used = torch.optim.AdamW(params)
    params[0].grad = torch.ones(4, 4)
    used.step()
    with pytest.raises(ValueError, match="already holds state"):
        DistributedOptimizer(used, ParallelMesh.single())


@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_a_model_that_cannot_split_is_refused_before_any_rank_starts(tmp_path, start_method):
    from tests.helpers.models import loader, token_data

    module = pl.LightningModule()
    module.gpt = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=3, n_embd=12))
    strategy = SeqParallelStrategy(tp=2, launch=LaunchConfig(start_method=start_method))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"n_head = 3 is not divisible by the tensor-parallel size tp = 2"):
        trainer.fit(module, loader(token_data(1, 1)))
    assert getattr(trainer.strategy.launcher, "procs", []) == [] and not torch.distributed.is_initialized()


def test_a_pipeline_split_the_model_cannot_take_is_refused_before_any_rank_starts(tmp_path):
    from tests.helpers.models import loader, token_data

    with pytest.raises(ValueError, match=r"pipeline_split=\[3\] must give 2 positive layer counts \(pp=2 × "
                                         r"virtual_stages=1\)"):
        SeqParallelStrategy(pp=2, layout=Layout(pipeline_split=[3]))  # in the constructor: a recipe fails at once
    module = pl.LightningModule()
    module.gpt = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=8))
    strategy = SeqParallelStrategy(pp=2, layout=Layout(pipeline_split=[3, 3]))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"pipeline_split=\[3, 3\] must give 2 positive layer counts .* that sum to "
                                         r"the model's 4 layers"):
        trainer.fit(module, loader(token_data(1, 1)))
    assert getattr(trainer.strategy.launcher, "procs", []) == [] and not torch.distributed.is_initialized()


def test_a_read_only_cache_folder_is_refused_with_the_cache_dir_advice(tmp_path, monkeypatch):
    """A read-only corpus folder (EROFS on a read-only mount; root passes permission bits, so it is simulated)."""
    import errno

    from lightning_seqpar.data import cache
    from lightning_seqpar.data.tokenizer import ByteTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 10)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache, "TokenFileWriter", read_only)
    with pytest.raises(PermissionError, match=r"Cannot write the token cache .*corpus.txt.* \(Read-only file system\): "
                                              r"set data.cache_dir"):
        cache.ensure_token_cache(corpus, ByteTokenizer(), progress=False)


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_documented_auto_layout_example_has_a_layout_that_fits():
    """conf/strategy/auto.yaml's command line, as written: its budget admits a layout of its model on its devices
    (before: 2e6 bytes, which none fits)."""
    import re
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_seqpar.lightning.auto_layout import AutoLayout, rank_layouts
    from lightning_seqpar.plan import inventory_of_hf_model
    from lightning_seqpar.plan.measuring.models import meta_model

    root = Path(__file__).resolve().parents[2]
    command = next(line for line in (root / "conf" / "strategy" / "auto.yaml").read_text().splitlines()
                   if "recipes/pretrain_gpt.py" in line)
    overrides = command.split("recipes/pretrain_gpt.py", 1)[1].split()
    with initialize_config_dir(str(root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for key in ("kind", "block_size", "attn_implementation"):
        model.pop(key)
    inventory = inventory_of_hf_model(meta_model({**model, "vocab_size": 256}))  # the corpus's byte vocabulary
    auto = AutoLayout(**OmegaConf.to_container(cfg.strategy.layout, resolve=True))
    ranked = rank_layouts(inventory, cfg.trainer.devices, auto.seq_len, auto, auto.memory_budget, precision="32-true",
                          gpus_per_node=cfg.trainer.devices)
    assert ranked and re.search(r"memory_budget=\d", command)


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_a_budget_no_layout_fits_is_refused_once_before_any_rank_starts(tmp_path):
    from lightning_seqpar.lightning.auto_layout import AutoLayout
    from tests.helpers.models import SEQ, build, loader, token_data

    strategy = SeqParallelStrategy(layout=AutoLayout(seq_len=SEQ, batch_size=2, memory_budget="1KB"),
                                   launch=LaunchConfig(start_method="popen"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path,
                         precision="32-true")
    with pytest.raises(ValueError, match=r"layout=auto: no layout of this model fits 0.8 × 1e-06 GB per device on 2 "
                                         r"devices"):
        trainer.fit(build("hf", labels=True), loader(token_data(1, 1)))
    assert getattr(trainer.strategy.launcher, "procs", []) == [] and not torch.distributed.is_initialized()


LAYOUT_ERRORS = [  # (strategy, model, callbacks, the one message): each checked before any rank starts
    (dict(tp=1, pp=2, layout=Layout(pipeline_split=[3, 1])), dict(n_layer=2), (),
     r"pipeline_split=\[3, 1\] must give 2 positive layer counts .* that sum to the model's 2 layers"),
    (dict(tp=2, ep=2), dict(n_experts=3), (), r"3 experts do not split over ep=2 ranks"),
    (dict(tp=1, pp=2, layout=Layout(schedule="ZB-V")), dict(n_layer=2), (),
     r"4 pipeline stages need at least 4 transformer layers"),
    (dict(tp=2), {}, ("recompute mlp", "offload mlp"), r"mlp both recomputed \(mlp\) and offloaded"),
    (dict(tp=2, ep=2, rewriting=RewriteConfig(compile=True)), dict(n_experts=4), (),
     r"compile=True: the model holds a dropless mixture"),
]


@pytest.mark.parametrize("strategy_options, model, callbacks, match", LAYOUT_ERRORS)
def test_layout_errors_of_a_model_built_in_configure_model_come_before_any_rank_starts(
        tmp_path, strategy_options, model, callbacks, match):
    from lightning_seqpar import ActivationOffload
    from lightning_seqpar.models import GPTLightningModule
    from tests.helpers.models import loader, token_data

    module = GPTLightningModule(GPTConfig(vocab_size=16, block_size=8, n_head=2, n_embd=8, **{"n_layer": 2, **model}),
                                empty_init=True)  # built in configure_model, as every recipe's module
    made = [SelectiveRecompute(modules=["mlp"]) if c == "recompute mlp" else ActivationOffload(modules=["mlp"])
            for c in callbacks]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=SeqParallelStrategy(**strategy_options), logger=False,
                         default_root_dir=tmp_path, callbacks=made)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, loader(token_data(1, 1)))
    assert getattr(trainer.strategy.launcher, "procs", []) == [] and not torch.distributed.is_initialized()


def test_a_spawn_launch_checks_a_copy_of_a_module_built_in_configure_model(tmp_path):
    from lightning_seqpar.models import GPTLightningModule
    from tests.helpers.models import loader, token_data

    module = GPTLightningModule(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=3, n_embd=12), empty_init=True)
    strategy = SeqParallelStrategy(tp=2, launch=LaunchConfig(start_method="spawn"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"n_head = 3 is not divisible by the tensor-parallel size tp = 2"):
        trainer.fit(module, loader(token_data(1, 1)))
    assert not hasattr(module, "gpt")  # the module the spawn launcher sends is left unbuilt, as given
