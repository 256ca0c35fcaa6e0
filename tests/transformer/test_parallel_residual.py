"""A parallel residual from one norm (Cohere, Phi) projects that norm's output for both branches in one call: under
sequence parallelism one all-gather of it per layer, where a sequential block needs two."""

import torch
import torch.nn as nn

import lightning_seqpar.transformer.attention_part as attention_part
import lightning_seqpar.transformer.declared_block as declared_block
import lightning_seqpar.transformer.mlp_part as mlp_part
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from tests.helpers.models import SEQ, build


def _projection_calls(family, monkeypatch):
    torch.manual_seed(0)
    holder = nn.Module()
    holder.model = build("hf", family=family).model.double().eval()
    x = torch.randint(0, 13, (2, SEQ))
    with torch.no_grad():
        want = holder.model(input_ids=x).logits
    rewrite(holder, RewriteContext(ParallelGroup.virtual(1), True, None, True), verify=False)
    calls = []
    real = declared_block.column_parallel_linears
    for module in (declared_block, attention_part, mlp_part):  # the block projects shared inputs, each part its own
        monkeypatch.setattr(module, "column_parallel_linears", lambda x, layers, *a: calls.append(len(layers))
                            or real(x, layers, *a))
    with torch.no_grad():
        torch.testing.assert_close(holder.model(input_ids=x).logits, want, rtol=1e-12, atol=1e-12)
    return calls


def test_one_norm_feeding_both_branches_is_projected_once(monkeypatch):
    assert _projection_calls("llama", monkeypatch) == [3, 2] * 2  # q/k/v, then gate/up: two gathers per layer
    assert _projection_calls("cohere", monkeypatch) == [5] * 2  # q/k/v and gate/up of the same normed input: one
