"""A small mixture-of-experts layer's data and its one-process reference, computed token by token."""

import torch
import torch.nn.functional as F

from lightning_seqpar.lightning.callbacks import counting_host_reads
from lightning_seqpar.moe import GroupedExperts

E, H, F_, K, N = 8, 6, 4, 2, 5  # experts, hidden, expert width, experts per token, tokens per rank
EMPTY = 5  # no token is routed to this expert


def weights():
    """The whole layer's experts: ``gate_up_proj`` ``[E, 2f, h]`` and ``down_proj`` ``[E, h, f]``."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * F_, H, generator=g, dtype=torch.float64),
            torch.randn(E, H, F_, generator=g, dtype=torch.float64))


def data(rank):
    """Rank ``rank``'s tokens, skewed routing (experts 0-2 favoured, expert EMPTY never chosen), scores and the
    gradient its outputs receive."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    popularity = torch.tensor([6.0, 4.0, 3.0, 1.0, 1.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    ids = torch.multinomial(popularity.expand(N, E), K, replacement=False, generator=g)
    scores = torch.randn(N, K, generator=g, dtype=torch.float64).softmax(-1)
    upstream = torch.randn(N, H, generator=g, dtype=torch.float64)
    return x, ids, scores, upstream


def reference(ranks, keep=None):
    """One process, every expert, token by token: outputs and gradients of ``ranks``' data. ``keep(ids, scores)``: the
    (token, slot) pairs each rank's capacity keeps (``None``: every pair, dropless)."""
    gate_up, down = (w.clone().requires_grad_() for w in weights())
    inputs = [(x.clone().requires_grad_(), ids, s.clone().requires_grad_(), u) for x, ids, s, u in map(data, ranks)]
    loss, outs = 0.0, []
    for x, ids, scores, upstream in inputs:
        kept = keep(ids, scores) if keep is not None else None
        rows = []
        for i in range(N):
            row = torch.zeros(H, dtype=torch.float64)
            for j in range(K):
                if kept is not None and (i, j) not in kept:
                    continue
                e = int(ids[i, j])
                gate, up = (gate_up[e] @ x[i]).chunk(2)
                row = row + scores[i, j] * (down[e] @ (F.silu(gate) * up))
            rows.append(row)
        out = torch.stack(rows)
        outs.append(out.detach())
        loss = loss + (out * upstream).sum()
    loss.backward()
    return outs, [(x.grad, s.grad) for x, _, s, _ in inputs], gate_up.grad, down.grad


def local_experts(ep, ep_rank):
    """Expert-parallel rank ``ep_rank``'s ``E/ep`` experts of :func:`weights`, float64."""
    experts = GroupedExperts(E, H, F_, expert_parallel=ep).double()
    local = E // ep
    with torch.no_grad():
        for mine, full in zip((experts.gate_up_proj, experts.down_proj), weights()):
            mine.copy_(full[ep_rank * local:(ep_rank + 1) * local])
    return experts


def one_layer_call(dispatcher, experts, rank):
    """Rank ``rank``'s tokens through ``dispatcher`` and ``experts`` and back, then backward with its upstream gradient:
    the outputs, the gradients of tokens, scores and the local experts, and the host reads made."""
    x, ids, scores, upstream = data(rank)
    x.requires_grad_()
    scores.requires_grad_()
    with counting_host_reads() as reads:
        rows, routing = dispatcher.dispatch(x, ids, scores)
        out = dispatcher.combine(experts(rows, routing.tokens_per_expert, routing.expert_counts), routing, scores)
        (out * upstream).sum().backward()
    return dict(out=out.detach(), x=x.grad, scores=scores.grad, gate_up=experts.gate_up_proj.grad,
                down=experts.down_proj.grad, host_reads=(reads.scalars, reads.lists), routing=routing)
