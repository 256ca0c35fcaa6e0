"""GRPO's rollouts: G completions of each prompt sampled from the policy in its training layout, and the training
forward's log-probabilities of the same tokens.

:func:`rollout` draws through :func:`lightning_seqpar.generate` (every rank of the run together, the ranks of a
tensor-parallel group with the same prompts; a seeded generator gives the same samples whatever the layout) and
returns a :class:`Rollout`: the prompts repeated G times (each group's G completions adjacent), the completions, their
mask (1 on each completion's tokens up to and including its end-of-sequence token, TRL's ``completion_mask``) and the
rollout's own log-probabilities. :func:`policy_logps` runs the model's training forward on prompt + completion with
the same positions and returns each completion token's log-probability (``token_logps=True`` of
:class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`: vocabulary-parallel, in chunks under ``loss_chunk``): the
policy's (with gradients), the old policy's and the reference's (adapters off) all come from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Rollout:
    """G completions of each of a replica's prompts.

    Attributes:
        prompt_ids, prompt_mask: ``[N, P]`` (N = prompts · G), left-padded.
        completion_ids: ``[N, C]``, C ≤ max_completion_length (shorter when every row ended sooner), padded after each
            completion's end.
        completion_mask: ``[N, C]`` float32, 1 on a completion's tokens up to and including its end-of-sequence token.
        logps: ``[N, C]`` float32, the rollout's log-probability of each completion token (0 off the mask).
        group_size: G.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    logps: Tensor
    group_size: int

    def model_inputs(self, multiple: int = 1, pad: int = 0) -> dict[str, Tensor]:
        """The training forward's inputs ``[N, P + C']``: ``input_ids``, ``attention_mask``, ``position_ids`` (counted
        over the mask, as generation counted them) and ``labels`` (-100 off the completion tokens), padded on the
        right to a multiple of ``multiple`` (t under sequence parallelism)."""
        ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.completion_mask.to(self.prompt_mask.dtype)], dim=1)
        labels = torch.cat([torch.full_like(self.prompt_ids, -100),
                            self.completion_ids.masked_fill(self.completion_mask == 0, -100)], dim=1)
        extra = -ids.shape[1] % multiple
        ids, mask, labels = F.pad(ids, (0, extra), value=pad), F.pad(mask, (0, extra)), F.pad(labels, (0, extra),
                                                                                              value=-100)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        return dict(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)


def completion_mask(completions: Tensor, ends: Sequence[int]) -> Tensor:
    """``[N, C]`` float32: 1 up to and including each row's first end-of-sequence token (all of a row that has none)."""
    if not ends:
        return torch.ones(completions.shape, dtype=torch.float32, device=completions.device)
    ended = torch.isin(completions, torch.tensor(list(ends), device=completions.device))
    after = (ended.int().cumsum(-1) - ended.int()) > 0  # past the first end
    return (~after).float()


def completion_generators(seeds: Sequence[int], group_size: int, device: Any = "cpu") -> list[torch.Generator]:
    """One generator per completion, completion g of the prompt of seed ``seeds[i]`` seeded with ``seeds[i]·2¹⁶ + g``:
    each completion's draws depend on its prompt's seed (e.g. its index in the whole step) and g only, not on the
    replica or micro-batch it falls in.

    Raises:
        ValueError: G of 2¹⁶ or more.
    """
    if group_size >= 2**16:
        raise ValueError(f"grpo.num_generations={group_size}: below {2**16}.")
    return [torch.Generator(device).manual_seed(int(seed) * 2**16 + g) for seed in seeds for g in range(group_size)]


def rollout(module: Any, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, max_completion_length: int, *,
            temperature: float = 1.0, top_p: Optional[float] = None, top_k: Optional[int] = None,
            generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
            seeds: Optional[Sequence[int]] = None, eos_token_id: Union[int, Sequence[int], None] = None,
            pad_token_id: int = 0) -> Rollout:
    """Sample ``group_size`` completions of each prompt ``[n, P]`` (left-padded where ``prompt_mask`` has zeros) by
    :func:`lightning_seqpar.generate`. Collective: every rank of the run calls it. ``seeds`` (one per prompt): each
    completion draws from its own generator (:func:`completion_generators`), so the samples do not depend on how the
    step's prompts are split over replicas and micro-batches; else ``generator`` (one, or one per completion).

    Raises:
        ValueError: ``group_size`` below 2 (GRPO compares completions of one prompt), ``seeds`` not one per prompt,
            and as ``generate``.
    """
    from lightning_seqpar.generation import generate

    if group_size < 2:
        raise ValueError(f"grpo.num_generations={group_size}: GRPO compares G >= 2 completions of each prompt.")
    if seeds is not None:
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts: one per prompt.")
        generator = completion_generators(seeds, group_size, prompt_ids.device)
    ids, mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    tokens, logps = generate(module, ids, max_completion_length, attention_mask=mask, do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=top_k, generator=generator,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id, return_logprobs=True)
    completions = tokens[:, ids.shape[1]:]
    ends = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
    kept = completion_mask(completions, ends)
    return Rollout(ids, mask, completions, kept, logps * kept, group_size)


def policy_logps(model: Any, batch: Rollout, multiple: int = 1, pad: int = 0) -> Tensor:
    """``[N, C]``: each completion token's log-probability under ``model``'s training forward (0 off the mask), with
    gradients when enabled. ``model``: the causal LM (its loss a :class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`,
    as the strategy installs it; on one device install it: ``model.loss_function = CausalLMLoss(model.loss_function)``).
    Position j of the forward's ``[N, s]`` gives token j + 1's.

    Raises:
        ValueError: the model's loss did not come back per token (its loss function is not a ``CausalLMLoss``, or its
            forward does not pass keyword arguments on to it), naming the fix.
    """
    return _completion_positions(model, batch, multiple, pad, entropy=False)[0]


def policy_logps_and_entropy(model: Any, batch: Rollout, multiple: int = 1, pad: int = 0) -> tuple[Tensor, Tensor]:
    """:func:`policy_logps` and each completion position's entropy over the vocabulary ``[N, C]`` (nats, without
    gradients; 0 off the mask), from the same forward."""
    return _completion_positions(model, batch, multiple, pad, entropy=True)  # type: ignore[return-value]


def _completion_positions(model: Any, batch: Rollout, multiple: int, pad: int, entropy: bool) -> tuple[Tensor, ...]:
    inputs = batch.model_inputs(multiple, pad)
    want = tuple(inputs["labels"].shape)
    extra = {"token_entropy": True} if entropy else {}
    per_position = model(**inputs, token_logps=True, **extra).loss  # log p of the token after each position
    got = None if per_position is None else tuple(per_position.shape)
    if got != ((2, *want) if entropy else want):
        raise ValueError(f"{type(model).__name__} returned a loss of shape {got} for token_logps=True, not one per "
                         f"position {want}: its loss function is not lightning_seqpar's CausalLMLoss (the strategy "
                         f"installs it; on one device: model.loss_function = CausalLMLoss(model.loss_function)), or "
                         f"its forward does not pass keyword arguments to it.")
    first, width = batch.prompt_ids.shape[1] - 1, batch.completion_ids.shape[1]
    rows = per_position if entropy else per_position[None]
    kept = batch.completion_mask.to(rows.dtype)
    return tuple(values[:, first:first + width] * kept for values in rows)
