"""Packed documents stay apart: change one token of document k and the logits that change are exactly document k's
positions at or after it, on one rank with nothing split around the layers (tp 1: the model's entry alone), on one
cp rank (tp 2) and under cp 2 and 4, ring and all-to-all. (transformers' eager and
SDPA kernels, given the same position ids on one device, change every later position.)"""

import pytest
import torch

from lightning_seqpar.context_parallel import ContextParallel, local_indices
from lightning_seqpar.parallel import ParallelMesh
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

S, LENGTHS, CHANGED = 16, (5, 4, 7), 6  # documents at 0-4, 5-8, 9-15; the token at 6 (document 1) changes
POSITIONS = torch.cat([torch.arange(n) for n in LENGTHS])[None]


def _inputs():
    x = torch.randint(1, 13, (1, S), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[0, CHANGED] = (x[0, CHANGED] % 12) + 1
    return x, changed


def _logits(rank, world_size, tp, cp, comm):
    mesh = ParallelMesh.build(tp, 1, "cpu", cp=cp)
    torch.manual_seed(0)
    module = build("hf", layers=2, kv_heads=4 if comm == "all_to_all" else 2).double().eval()  # a2a: heads ÷ c
    rewrite(module, RewriteContext(mesh.tensor, True, None, True, context=ContextParallel(mesh.context, comm)))
    out = []
    with torch.no_grad():
        for x in _inputs():
            local = module.model(input_ids=x, position_ids=POSITIONS).logits
            local = local.gathered() if hasattr(local, "gathered") else local  # [1, s/c, v], this rank's positions
            every = mesh.context.all_gather(local.contiguous(), dim=1)  # cp rank order
            order = torch.cat([local_indices(S, cp, r) for r in range(cp)])
            out.append(torch.empty_like(every).index_copy_(1, order, every))
    return out


@pytest.mark.parametrize("tp,cp,comm", [(1, 1, "ring"), (2, 1, "ring"), (1, 2, "ring"), (1, 2, "all_to_all"), (1, 4, "ring"),
                                        (1, 4, "all_to_all")])
def test_a_changed_token_changes_only_its_documents_later_positions(tp, cp, comm):
    before, after = run_distributed(_logits, tp * cp, tp, cp, comm)[0]
    changed = ((before - after).abs().amax(-1) > 1e-12)[0].nonzero().flatten().tolist()
    assert changed == list(range(CHANGED, LENGTHS[0] + LENGTHS[1]))  # 6, 7, 8: document 1 from the change on


def test_one_process_without_the_strategy_does_attend_across_documents():
    # Why the isolation is ours to build: the same call on the unparallelized model changes document 2 as well.
    torch.manual_seed(0)
    module = build("hf", layers=2).double().eval()
    with torch.no_grad():
        before, after = (module.model(input_ids=x, position_ids=POSITIONS).logits for x in _inputs())
    changed = ((before - after).abs().amax(-1) > 1e-12)[0].nonzero().flatten().tolist()
    assert changed == list(range(CHANGED, S))
