"""Under context parallelism no rank makes a tensor of the whole sequence: every floating-point tensor created in a
training step (forward and backward, ring and all-to-all, tp 1 and tp 2 with SP) has no dimension of length s, and no
mask has two (the batch's ``[b, s]`` token ids, positions, labels and document/padding flags are what every rank is
given, and are the only tensors of length s); all-to-all attention's q/k/v/output hold whole sequences of a/c heads,
no larger than the rank's share. Checked with a dispatch mode that sees every operator's outputs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_seqpar.context_parallel import ContextParallel
from lightning_seqpar.parallel import ParallelMesh
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

S = 24  # no other dimension of the tiny model is 24


class _WholeSequence(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (
                    (t.is_floating_point() and S in t.shape) or list(t.shape).count(S) >= 2):
                self.found.append((f"{func}: {t.dtype} {tuple(t.shape)}", t.numel()))
        return out


def _step(rank, world_size, tp, cp, comm):
    mesh = ParallelMesh.build(tp, 1, "cpu", cp=cp)
    torch.manual_seed(0)
    module = build("hf", labels=True, kv_heads=4).double()
    rewrite(module, RewriteContext(mesh.tensor, True, None, True, context=ContextParallel(mesh.context, comm)))
    x = torch.randint(0, 13, (3, S), generator=torch.Generator().manual_seed(1))  # b·s/c ≠ s
    mask = torch.ones_like(x)
    mask[0, -2:] = 0
    with _WholeSequence() as mode:
        loss = module.model(input_ids=x, labels=x, attention_mask=mask).loss
        loss.backward()
    return mode.found, float(loss)


@pytest.mark.parametrize("tp,cp,comm", [(1, 2, "ring"), (1, 2, "all_to_all"), (2, 2, "ring")])
def test_no_rank_makes_a_tensor_of_the_whole_sequence(tp, cp, comm):
    results = run_distributed(_step, tp * cp, tp, cp, comm)
    local = 3 * (S // cp) * 16  # [b, s/c, h]: what a rank holds of a layer's input
    for found, _ in results:
        if comm == "all_to_all":  # core attention sees whole sequences of a/c heads: no more than the local share
            found = [f for f in found if f[1] > local]
        assert found == []
    assert len({loss for _, loss in results}) == 1  # every rank holds the whole sequence's loss
