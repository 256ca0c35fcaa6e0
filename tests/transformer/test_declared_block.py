"""A user's own block, declared in a few lines (tests/helpers/user_block.py), trains at tp 2 like one process.

The block is written in nanoGPT's shape (fused c_attn, c_proj, c_fc, LayerNorm, causal SDPA); float64, loss and
every gradient over 3 AdamW steps; SP on and off, dropout on (the dropout streams differ from one process, so
dropout runs are compared with dropout at 0 only through their loss being finite and identical across ranks).
"""

import pytest
import torch

from lightning_seqpar import explain
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.rewriting.declared_policy import DeclaredBlockPolicy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, reference_run, token_data
from tests.helpers.parity import STEPS, Case, fit
from tests.helpers.user_block import BLOCK_SPEC, POLICY, Block

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

POLICIES = (("policies", (POLICY,)),)
CASES = [Case("nano", 2, True, None, strategy=POLICIES), Case("nano", 2, False, None, strategy=POLICIES),
         Case("nano", 2, True, "selective", strategy=POLICIES)]


def _run(rank, world_size):
    return {case: fit(case, world_size) for case in CASES}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'sp' if c.sequence_parallel else 'nosp'}-{c.recompute}")
def test_a_declared_user_block_trains_like_one_process(runs, case):
    ref = reference_run(build("nano"), token_data(STEPS, 1), STEPS, 1)
    for rank in range(2):
        rec = runs[rank][case]
        torch.testing.assert_close(torch.tensor(rec.losses, dtype=torch.float64),
                                   torch.tensor(ref.losses, dtype=torch.float64), rtol=1e-9, atol=1e-11)
        for step, (got, want) in enumerate(zip(rec.grads, ref.grads)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")


def test_explain_shows_the_declared_split(capsys):
    plan = explain(build("nano"), tp=2, policies=[POLICY])
    assert [e.name for e in plan.entries] == ["h.0", "h.1"]
    assert "Block (declared block): 4 heads → 2 per rank (attn.c_attn column-parallel" in str(plan)


def test_a_declaration_naming_a_missing_part_is_refused_with_what_exists():
    bad = DeclaredBlockPolicy(Block, BlockSpec(**{**BLOCK_SPEC.__dict__, "mlp_in": "mlp.fc1"}))
    with pytest.raises(ValueError, match=r"h.0 \(Block\): the block declaration names a part that does not exist: "
                                         r"'mlp.fc1': mlp has no 'fc1' \(its submodules: \['c_fc', 'c_proj', 'dropout', 'gelu'\]\)"):
        explain(build("nano"), tp=2, policies=[bad])


def test_an_unknown_hugging_face_layout_names_what_was_found_and_the_declaration():
    from transformers import OPTConfig, OPTForCausalLM

    holder = torch.nn.Module()  # OPT: fc1/fc2 directly in the layer, no mlp submodule: neither built-in layout
    holder.model = OPTForCausalLM(OPTConfig(vocab_size=13, max_position_embeddings=8, hidden_size=16, num_hidden_layers=1,
                                            ffn_dim=32, num_attention_heads=4, word_embed_proj_dim=16))
    with pytest.raises(ValueError, match=r"Block-like classes found .*OPTDecoderLayer.*DeclaredBlockPolicy\(MyBlock, BlockSpec\("):
        explain(holder, tp=2)
