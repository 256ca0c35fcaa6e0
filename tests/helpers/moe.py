"""A small mixture-of-experts layer's data and its one-process reference, computed token by token."""

import torch
import torch.nn.functional as F

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


def reference(ranks):
    """One process, every expert, token by token: outputs and gradients of ``ranks``' data."""
    gate_up, down = (w.clone().requires_grad_() for w in weights())
    inputs = [(x.clone().requires_grad_(), ids, s.clone().requires_grad_(), u) for x, ids, s, u in map(data, ranks)]
    loss, outs = 0.0, []
    for x, ids, scores, upstream in inputs:
        rows = []
        for i in range(N):
            row = 0.0
            for j in range(K):
                e = int(ids[i, j])
                gate, up = (gate_up[e] @ x[i]).chunk(2)
                row = row + scores[i, j] * (down[e] @ (F.silu(gate) * up))
            rows.append(row)
        out = torch.stack(rows)
        outs.append(out.detach())
        loss = loss + (out * upstream).sum()
    loss.backward()
    return outs, [(x.grad, s.grad) for x, _, s, _ in inputs], gate_up.grad, down.grad
