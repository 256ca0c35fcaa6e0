"""A rewritten gpt-oss (attention sinks looked up on their block, the experts' own gating method bound to a namespace
of its attributes) is a value like any module: ``copy.deepcopy`` gives a model with its own parameters, and a pickled
copy computes the same logits."""

import copy
import pickle

import torch

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.models import VOCAB


def test_a_rewritten_gpt_oss_copies_and_pickles():
    module = HFCausalLM("gpt_oss", labels=True)
    rewrite(module, RewriteContext(ParallelGroup(), True, None, True))
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    copied = copy.deepcopy(module)
    with torch.no_grad():
        want = module.model(input_ids=x).logits
        assert torch.equal(pickle.loads(pickle.dumps(module)).model(input_ids=x).logits, want)
        assert torch.equal(copied.model(input_ids=x).logits, want)
        copied.model.model.layers[0].self_attn.sinks.add_(1.0)  # the copy's own sinks, not the original's
        assert not torch.equal(copied.model(input_ids=x).logits, want)
        assert torch.equal(module.model(input_ids=x).logits, want)
