"""``ParallelConfig``: the layout and its settings as one value, the strategy's flat keywords its shorthands; sizes
checked once, a layout the world cannot take refused in the Trainer's constructor, and experts split (``ep > 1``)
over a model that has none refused at setup."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.lightning.config import ParallelConfig
from lightning_seqpar.build import check_experts
from lightning_seqpar.models import GPT, GPTConfig
from lightning_seqpar.parallel.placement import ShardSpec, place
from lightning_seqpar.pipeline_parallel import PipelineConfig


def test_flat_keywords_are_shorthands_for_the_config():
    flat = SeqParallelStrategy(tp=2, pp=2, cp=2, cp_comm="all_to_all", num_microbatches=4, sequence_parallel=False,
                               loss_chunk=None)
    given = SeqParallelStrategy(parallel=ParallelConfig(
        tp=2, cp=2, cp_comm="all_to_all", pipeline=PipelineConfig.build(2, 4), sequence_parallel=False,
        loss_chunk=None))
    assert flat.parallel == given.parallel
    assert (given.tp, given.pp, given.cp) == (2, 2, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(parallel=ParallelConfig(tp=2), tp=2), r"with the keyword\(s\) tp too"),
    (dict(parallel=ParallelConfig(), cp=2, loss_chunk=8), r"keyword\(s\) cp, loss_chunk too"),
    (dict(parallel={"tp": 2}), r"a ParallelConfig\(tp=\.\.\."),
])
def test_a_setting_is_given_once(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SeqParallelStrategy(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(ep=0), "`ep` must be a positive integer, got 0"),
    (dict(expert_tp=1.5), "`expert_tp` must be a positive integer, got 1.5"),
    (dict(cp_comm="ulysses"), "cp_comm='ulysses'"),
    (dict(loss_chunk=0), "loss_chunk=0: a positive number"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_an_expert_grid_the_world_cannot_fold_is_refused_before_any_rank_starts(tmp_path):
    strategy = SeqParallelStrategy(parallel=ParallelConfig(tp=2, ep=3))
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


def test_expert_tp_is_a_shorthand_and_must_fold_with_ep_over_the_dense_ranks(tmp_path):
    assert SeqParallelStrategy(tp=2, ep=2, expert_tp=2).parallel == ParallelConfig(tp=2, ep=2, expert_tp=2)
    strategy = SeqParallelStrategy(tp=2, ep=2, expert_tp=2)
    with pytest.raises(ValueError, match=r"ep·etp = 2·2 = 4 must divide tp·cp·dp = 2"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, default_root_dir=tmp_path)
    assert not torch.distributed.is_initialized()
