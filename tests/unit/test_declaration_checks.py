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


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_the_tested_hugging_face_families_pass_their_self_check(family):
    plan = explain(build("hf", family=family), tp=2)
    assert [e.policy.role for e in plan.entries] == ["vocabulary", "layer", "layer"]


def test_gemma_blocks_are_refused_naming_the_parts_the_llama_layout_lacks():
    module = build("hf", family="gemma2")
    with pytest.raises(ValueError, match=r"Gemma2DecoderLayer\): this Hugging Face block has parts the Llama layout "
                                         r"does not have: pre_feedforward_layernorm\.weight.*not supported"):
        explain(module, tp=2)


def test_a_block_that_computes_what_the_layout_does_not_say_is_caught():
    module = build("hf", family="olmo")  # the Llama layout's parts, but q/k/v clipped (clip_qkv) in its forward
    with pytest.raises(ValueError, match=r"OlmoDecoderLayer\): the tensor-parallel block .* does not compute"):
        explain(module, tp=2)


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
