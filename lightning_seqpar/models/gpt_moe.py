"""The reference GPT's mixture of experts, as single-device code: a softmax top-k router, packed SwiGLU experts computed
densely, and the MLP slot they fill (:class:`MoEMLP`). The rewrite sends each token to its k experts only
(:mod:`lightning_seqpar.transformer.moe_part`). Each takes the model's ``GPTConfig`` (``n_embd``, ``n_experts``,
``experts_per_token``, ``expert_ffn_hidden_size``, ``dropout``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.moe.balancing import load_balancing_loss, router_z_loss


def router_losses(config: Any, logits: tuple[Optional[Tensor], ...]) -> Tensor:
    """``aux_loss_coef ×`` the load-balancing loss (pooled over the layers, or each layer's summed:
    ``config.aux_loss_type``) ``+ z_loss_coef ×`` the router z-loss of one forward's router logits ``[n, E]`` per layer,
    over every rank's tokens when a parallel block produced them (:mod:`lightning_seqpar.moe.balancing`)."""
    logits = tuple(x for x in logits if x is not None)  # under pipeline parallelism: the layers that ran here
    if not logits:
        return torch.zeros((), dtype=torch.float32)
    loss = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    if config.aux_loss_coef > 0:
        loss = loss + config.aux_loss_coef * load_balancing_loss(
            logits, config.n_experts, config.experts_per_token, per_layer=config.aux_loss_type == "per_layer")
    if config.z_loss_coef > 0:
        loss = loss + config.z_loss_coef * router_z_loss(logits)
    return loss

class TopKRouter(nn.Module):
    """Scores ``[n, h]`` tokens against E experts: ``(logits [n, E], scores [n, k], experts [n, k])``, the softmax
    (float32) of the top k renormalized (Mixtral's router); the logits kept as :attr:`last_logits` for the
    load-balancing loss."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.n_embd))
        self.last_logits: Optional[Tensor] = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(x, self.weight)
        top, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        self.last_logits = logits
        return logits, (top / top.sum(-1, keepdim=True)).to(x.dtype), chosen


class Experts(nn.Module):
    """E SwiGLU experts as packed weights (``gate_up_proj`` ``[E, 2f, h]``, ``down_proj`` ``[E, h, f]``), computed
    densely: every expert on every token, weighted by the router's scores (zero where a token is not routed). Plain
    single-device code: the rewrite sends each token to its k experts only."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        width = config.expert_ffn_hidden_size or 4 * config.n_embd // config.experts_per_token
        self.gate_up_proj = nn.Parameter(torch.empty(config.n_experts, 2 * width, config.n_embd))
        self.down_proj = nn.Parameter(torch.empty(config.n_experts, config.n_embd, width))
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor, chosen: Tensor, scores: Tensor) -> Tensor:
        weights = torch.zeros(x.shape[0], self.down_proj.shape[0], dtype=scores.dtype, device=x.device)
        weights = weights.scatter(1, chosen, scores)  # [n, E]
        gate, up = torch.einsum("nh,efh->enf", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("enf,ehf->enh", self.act_fn(gate) * up, self.down_proj)
        return torch.einsum("enh,ne->nh", out, weights)


class MoEMLP(nn.Module):
    """A mixture of experts in the MLP's place: ``[b, s, h]`` → ``[b, s, h]``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        _, scores, chosen = self.gate(tokens)
        return self.dropout(self.experts(tokens, chosen, scores).view(x.shape))
