"""Prompts for generation tests: each data-parallel replica its own."""

from __future__ import annotations

import torch


def replica_prompts(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s prompts ``[2, 5]`` and attention mask: two rows, the first left-padded by two."""
    prompts = (torch.tensor([[0, 0, 5, 3, 7], [4, 1, 2, 9, 11]]) + 3 * replica) % 13
    return prompts, torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
