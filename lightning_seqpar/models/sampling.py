"""Autoregressive sampling, shared by the reference GPT and its parallel version."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class Sampling:
    """Adds :meth:`generate` to a language model whose ``forward(idx [b, s])`` returns logits ``[b, s, v]`` and
    whose ``config.block_size`` is its context length."""

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx [b, s]``; returns ``[b, s + max_new_tokens]``."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]  # type: ignore[attr-defined]
            logits = self(context)[:, -1, :].float() / temperature  # type: ignore[operator]  # (b, v)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
