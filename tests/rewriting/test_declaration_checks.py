"""Nothing is silently different: a block with parts its declaration does not name is refused, and a parallel
block that computes something else than its block is caught by the rewrite's self-check, before any process
communicates. Tested through ``explain`` (no process group), which runs the checks the strategy runs."""

import dataclasses

import pytest
import torch.nn as nn

from lightning_seqpar import DeclaredBlockPolicy, explain
from lightning_seqpar.parallel.emulated import run_emulated
from tests.helpers.models import build
from tests.helpers.user_block import BLOCK_SPEC, Block, NanoLM


def test_the_users_declared_block_passes_its_self_check_at_each_tp():
    for tp in (1, 2, 4):
        plan = explain(NanoLM(), tp=tp, policies=[DeclaredBlockPolicy(Block, BLOCK_SPEC)])
        assert len(plan.entries) == 2


def test_a_block_with_an_undeclared_parameter_is_refused_naming_it():
    module = NanoLM()
    for block in module.h:
        block.attn.scale = nn.Parameter(block.ln_1.weight.detach().clone())  # used by nothing the spec names
    with pytest.raises(ValueError, match=r"h\.0 \(Block\): parts of the block are in no declared part.*attn\.scale "
                                         r"\(parameter \(16,\)\).*q_norm=/k_norm="):
        explain(module, tp=2, policies=[DeclaredBlockPolicy(Block, BLOCK_SPEC)])


def test_the_self_check_catches_a_wrong_declaration_and_can_be_turned_off():
    wrong = dataclasses.replace(BLOCK_SPEC, attention_norm="ln_2", mlp_norm="ln_1")  # the two norms swapped
    module = NanoLM()
    with pytest.raises(ValueError, match=r"h\.0 \(Block\): the tensor-parallel block built from its declaration does "
                                         r"not compute what the block computes: .* at tp=2, the outputs differ by"):
        explain(module, tp=2, policies=[DeclaredBlockPolicy(Block, wrong)])
    plan = explain(module, tp=2, policies=[DeclaredBlockPolicy(Block, wrong)], verify=False)
    assert len(plan.entries) == 2


def test_emulated_ranks_combine_tensors_as_collectives_do():
    import torch

    def collectives(group):
        x = torch.arange(4.0) + 10 * group.rank
        return (group.all_gather(x), group.reduce_scatter(x.clone()), group.all_reduce(x.clone()),
                group.broadcast(x.clone(), src_rank=1))

    ranks = run_emulated(2, collectives)
    for rank, (gathered, scattered, reduced, broadcast) in enumerate(ranks):
        assert gathered.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
        assert reduced.tolist() == [10, 12, 14, 16]
        assert scattered.tolist() == [[10, 12], [14, 16]][rank]
        assert broadcast.tolist() == [10, 11, 12, 13]


class RotaryBlock(Block):
    """litgpt's convention: the model passes the rotary tables positionally, ``block(x, cos, sin)``."""

    def forward(self, x, cos, sin, mask=None):
        return super().forward(x * cos[: x.shape[1]].mean() + sin[: x.shape[1]].mean())


def test_a_block_whose_forward_requires_arguments_it_cannot_use_is_refused_before_training():
    module = NanoLM()
    module.h = nn.ModuleList([RotaryBlock(16, 4, 0.0) for _ in range(2)])
    for verify in (True, False):  # whether or not the self-check runs
        with pytest.raises(ValueError, match=r"h\.0 \(RotaryBlock\): its forward requires \['cos', 'sin'\], which the "
                                             r"parallel block .* cannot use"):
            explain(module, tp=2, policies=[DeclaredBlockPolicy(RotaryBlock, BLOCK_SPEC)], verify=verify)


def test_blocks_of_one_class_are_checked_once_per_configuration():
    """A later layer that differs from the first by a plain attribute gets its own check (SmolLM3's NoPE layers)."""

    class ScaledBlock(Block):
        def __init__(self, *args, scale: float = 1.0) -> None:
            super().__init__(*args)
            self.scale = scale

        def forward(self, x):
            return super().forward(x) * self.scale

    module = NanoLM()
    module.h = nn.ModuleList([ScaledBlock(16, 4, 0.0), ScaledBlock(16, 4, 0.0, scale=2.0)])
    with pytest.raises(ValueError, match=r"h\.1 \(ScaledBlock\): the tensor-parallel block .* does not compute"):
        explain(module, tp=2, policies=[DeclaredBlockPolicy(ScaledBlock, BLOCK_SPEC)])


def test_a_rewritten_block_refuses_what_it_does_not_understand_by_name():
    import torch

    from lightning_seqpar import RewriteContext
    from lightning_seqpar.parallel import ParallelGroup
    from lightning_seqpar.transformer.declared_block import ParallelBlock

    block = ParallelBlock(Block(16, 4, 0.0), BLOCK_SPEC, RewriteContext(ParallelGroup(), True, None, True))
    x = torch.randn(2, 8, 16)
    assert block(x, position_ids=torch.arange(8), use_cache=True, output_attentions=False).shape == x.shape
    with pytest.raises(TypeError, match=r"tensor-parallel Block was called with 'bias' \(a tensor of shape \(2, 8\)\), "
                                        r"which its tensor-parallel version does not understand"):
        block(x, bias=torch.zeros(2, 8))
    with pytest.raises(TypeError, match=r"alibi=a tensor of shape \(2, 8\): refused when given \(ALiBi"):
        block(x, alibi=torch.zeros(2, 8))
    with pytest.raises(TypeError, match=r"1 positional argument\(s\) after the hidden states; argument 1 is a tensor.*"
                                        r"BlockSpec\(arguments="):
        block(x, torch.zeros(8))
    with pytest.raises(TypeError, match=r"output_attentions=bool True: refused when true"):
        block(x, output_attentions=True)
    block(x, alibi=None)  # an argument left at None changes nothing
