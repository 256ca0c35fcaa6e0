"""The next token from a row's logits: greedy, or drawn after temperature, top-k and top-p, in the order transformers'
``generate`` applies its logits processors (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``), so a seeded draw picks what transformers picks from the same logits and generator state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenChoice:
    """How the next token is chosen.

    Attributes:
        do_sample: draw from the processed distribution (``False``: the most likely token).
        temperature: the logits are divided by it (> 0).
        top_k: keep the k most likely tokens (ties at the k-th kept too); ``None``: all.
        top_p: keep the smallest set of most likely tokens whose probability reaches p (at least one); ``None``: all.

    Raises:
        ValueError: a temperature ≤ 0, a ``top_k`` < 1 or a ``top_p`` outside (0, 1], naming the value.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 (do_sample=False for greedy decoding).")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r}: a positive integer, or None for every token.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: in (0, 1], or None for every token.")

    def scores(self, logits: Tensor) -> Tensor:
        """``logits`` ``[b, v]`` (float32) processed for a draw: divided by the temperature, then everything outside
        the top-k and the top-p set at ``-inf``."""
        scores = logits / self.temperature if self.temperature != 1.0 else logits
        if self.top_k is not None:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1])).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=False)
            below = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p  # the least likely, up to 1 - p of the mass
            below[..., -1] = False  # the most likely is always kept
            scores = scores.masked_fill(below.scatter(-1, order, below), float("-inf"))
        return scores

    def pick(self, logits: Tensor, generator: Union[torch.Generator, Sequence[torch.Generator], None]) -> Tensor:
        """The next token ``[b]`` from ``logits`` ``[b, v]`` (float32); ``generator``: one for the batch (rows drawn
        in order), or one per row (each row's draws its own: the same whichever rows share its batch).

        Raises:
            ValueError: a sequence of generators of another length than the rows.
        """
        if not self.do_sample:
            return logits.argmax(-1)
        probabilities = self.scores(logits).softmax(-1)
        if generator is None or isinstance(generator, torch.Generator):
            return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
        if len(generator) != len(probabilities):
            raise ValueError(f"{len(generator)} generators for {len(probabilities)} rows: one per row, or one for all.")
        return torch.cat([torch.multinomial(row[None], 1, generator=g)[0] for row, g in zip(probabilities, generator)])
