"""How :func:`~lightning_seqpar.generation.generate.generate` runs a model's forwards, one per new token.

- :class:`CachedSteps`: a Hugging Face causal LM (PEFT-wrapped or not). The prompt runs once (the prefill), then each
  new token alone (a decode step), over a transformers ``DynamicCache`` the rewritten layers fill with this rank's
  heads (:mod:`lightning_seqpar.transformer.kv_cache`); left padding through the attention mask, positions counted
  over it as transformers' ``generate`` counts them.
- :class:`RecomputedSteps`: a model called ``model(idx [b, s]) -> logits [b, s, v]`` (the reference GPT,
  :class:`~lightning_seqpar.models.parallel_gpt.ParallelGPT`): each token runs the forward over the whole sequence
  so far (``O(n²)``; its blocks take no cache), its last ``config.block_size`` tokens once longer, as its own
  sampling does; prompts of one length (it has no attention mask).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_seqpar.hf.kv_cache import new_cache
from lightning_seqpar.transformer.kv_cache import step_sequence_parallel


class ModelSteps(Protocol):
    """One model's forwards in a generation."""

    def begin(self) -> tuple:
        """Before a forward: what its activations' shapes depend on (the pipeline's transfer signature)."""

    def forward(self) -> Tensor:
        """The next position's logits ``[b, v]`` (float32); raises the pipeline's ``StageOutput`` on a stage before
        the last."""

    def advance(self, token: Tensor, remote: Any) -> None:
        """After the token ``[b]`` is chosen: the next forward's inputs (``remote``: the pipeline's
        :class:`~.staged_forward.StagedForward`, or ``None``)."""


def model_steps(model: Any, ids: Tensor, mask: Tensor, sequence_parallel: bool, t: int) -> ModelSteps:
    """The steps of ``model``: cached for a Hugging Face model (it has ``get_input_embeddings``), else recomputed.

    Raises:
        ValueError: a left-padded prompt for a model without an attention mask; a model with a block declared
            non-causal (its positions see later ones: not a language model to continue).
    """
    non_causal = [name for name, m in model.named_modules()
                  if getattr(getattr(getattr(m, "spec", None), "attention", None), "causal", True) is False]
    if non_causal:
        raise ValueError(f"{type(model).__name__} has blocks declared non-causal ({non_causal[0]}, ...: "
                         f"BlockSpec.causal=False): generation continues a causal language model, each position "
                         f"seeing only those before it.")
    if hasattr(model, "get_input_embeddings"):
        return CachedSteps(model, ids, mask, sequence_parallel, t)
    if bool((mask == 0).any()):
        raise ValueError(f"{type(model).__name__} takes no attention mask, so its prompts cannot be left-padded: "
                         f"generate prompts of one length together (or one at a time).")
    return RecomputedSteps(model, ids)


class CachedSteps:
    """A prefill, then one position per step over the layers' key/value cache (see the module docstring)."""

    def __init__(self, model: Any, ids: Tensor, mask: Tensor, sequence_parallel: bool, t: int) -> None:
        self.model, self.mask, self.sequence_parallel, self.t = model, mask, sequence_parallel, t
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers' generate counts them
        self.step = dict(input_ids=ids, position_ids=positions)  # the prefill: the whole prompt in one forward
        self.caches = new_cache(model)
        self.cache = next(iter(self.caches.values()))

    def begin(self) -> tuple:
        new, rows = self.step["input_ids"].shape[1], self.mask.shape[0]
        # Marked here for every stage's blocks (a later stage has no block entering the region to mark it).
        return new, rows, step_sequence_parallel(self.cache, True, new, self.sequence_parallel, self.t)

    def forward(self) -> Tensor:
        out = self.model(**self.step, attention_mask=self.mask, **self.caches, use_cache=True)
        return out.logits[:, -1].float()  # [b, v], float32: as training computes it

    def advance(self, token: Tensor, remote: Any) -> None:
        if remote is not None:  # the layers other stages hold: their slots count the positions too
            remote.advance_remote(self.cache, self.step["input_ids"].shape[1], token.device)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.step = dict(input_ids=token[:, None], position_ids=self.step["position_ids"][:, -1:] + 1)


class RecomputedSteps:
    """The whole sequence so far in each forward (see the module docstring)."""

    def __init__(self, model: Any, ids: Tensor) -> None:
        self.model, self.ids = model, ids
        self.context = getattr(getattr(model, "config", None), "block_size", None)  # its context length, if any

    def _window(self) -> Tensor:
        """The last ``block_size`` tokens (the reference GPT's own sampling crops alike)."""
        return self.ids if self.context is None else self.ids[:, -self.context:]

    def begin(self) -> tuple:
        return tuple(self._window().shape)

    def forward(self) -> Tensor:
        return self.model(self._window())[:, -1].float()

    def advance(self, token: Tensor, remote: Optional[Any]) -> None:
        self.ids = torch.cat([self.ids, token[:, None]], dim=1)
