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


class _Logits(TorchDispatchMode):
    """The largest floating-point [b, s, v] tensor (v = 13, unpadded at tp 1): the logits and their gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3 and t.shape[-1] == 13:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_logits(rank, world_size, loss_chunk):
    mesh = ParallelMesh.build(1, 1, "cpu", cp=2)
    torch.manual_seed(0)
    module = build("hf", labels=True).double()
    rewrite(module, RewriteContext(mesh.tensor, True, None, True, context=ContextParallel(mesh.context),
                                   loss_chunk=loss_chunk))
    x = torch.randint(0, 13, (3, S), generator=torch.Generator().manual_seed(1))
    with _Logits() as mode:
        loss = module.model(input_ids=x, labels=x).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return mode.largest, float(loss), grads


def test_the_chunked_loss_keeps_at_most_one_chunk_of_logits_and_computes_the_same():
    chunked = run_distributed(_largest_logits, 2, 3)[0]
    whole = run_distributed(_largest_logits, 2, None)[0]
    assert chunked[0] == 3 * 3 * 13  # [b, chunk, v]: forward and the backward's recomputation alike
    assert whole[0] == 3 * (S // 2) * 13  # unchunked: the rank's whole [b, s/c, v]
    assert abs(chunked[1] - whole[1]) <= 1e-12 * abs(whole[1])
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-10, atol=1e-12)
