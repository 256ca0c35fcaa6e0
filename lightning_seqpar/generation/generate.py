"""Text out of a model in the layout it trains in: every rank of the run calls :func:`generate` together, and each
data-parallel replica continues its own batch of prompts, no rank ever holding more of the model than it trains with.

A Hugging Face model's prompt runs in one forward (the prefill), then each new token in a forward of its one position
(the decode steps), the rewritten layers keeping this rank's keys and values in a transformers ``DynamicCache``
(:mod:`lightning_seqpar.transformer.kv_cache`: ``[b, a_kv/t, s, d]`` per layer; a step whose positions do not split
over t runs with sequence parallelism suspended); the reference GPT recomputes the sequence so far
(:mod:`.model_steps`). Experts over ep and expert_tp, pipeline stages in any placement (:mod:`.staged_forward`), the
trainer's precision (autocast under ``bf16-mixed``) as in training. The last position's logits are gathered over
the vocabulary's tensor-parallel split, and the token is chosen as transformers' ``generate`` chooses it (:mod:`.next_token`). A draw
is made by every rank from the same generator state and tensor-parallel rank 0's token is broadcast, so the ranks of a
tensor-parallel group cannot disagree where a kernel's rounding differs between devices. Rows stop at their
end-of-sequence token; every rank runs the same number of forwards (a mixture's dispatch spans the data-parallel
replicas), so the loop ends when every replica's rows have stopped.

Context parallelism is refused by name: a decoded position has no sequence to split.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.generation.model_steps import model_steps
from lightning_seqpar.generation.next_token import TokenChoice
from lightning_seqpar.generation.staged_forward import StagedForward


@torch.no_grad()
def generate(module: Any, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Optional[Tensor] = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None,
             generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             return_logprobs: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Continue ``input_ids`` ``[b, s]`` (this data-parallel replica's prompts, left-padded where ``attention_mask``
    ``[b, s]`` has zeros) by up to ``max_new_tokens`` tokens. Collective: every rank of the run calls it, the ranks of
    a tensor-parallel group with the same prompts.

    Args:
        module: a LightningModule trained by ``SeqParallelStrategy`` whose ``model`` is the causal LM (a Hugging Face
            model, PEFT-wrapped or not, called as ``model(input_ids=, attention_mask=, position_ids=, cache=)``; or the
            reference GPT, ``model(idx)``), or such a model itself on one process.
        do_sample, temperature, top_k, top_p: how each token is chosen (:class:`~.next_token.TokenChoice`).
        generator: the draws' generator (the same seed on every rank: the draw is broadcast from tensor-parallel
            rank 0 all the same), or one per row: each row's draws then do not depend on which rows share its batch
            (the same samples whatever the data-parallel split).
        eos_token_id: the token (or tokens) that ends a row; the row is padded with ``pad_token_id`` after it
            (default: the first end-of-sequence token, else 0).
        return_logprobs: also return the chosen tokens' log-probabilities ``[b, n]`` (float32) under the model's
            distribution (the unprocessed logits: what the training forward gives the same tokens).

    Returns:
        ``[b, s + n]`` token ids, ``n ≤ max_new_tokens`` (fewer when every row of every replica has ended); and, asked,
        the log-probabilities ``[b, n]``.

    Raises:
        ValueError: a prompt that is not ``[b, s]`` integer ids, a mask of another shape or padded on the right (or
            padded at all for the reference GPT), a negative ``max_new_tokens``, sampling settings out of range;
            naming the value and the fix.
        NotImplementedError: context parallelism, naming what to do instead.
    """
    choice = TokenChoice(do_sample, temperature, top_k, top_p)
    model, trainer, strategy = _model_and_strategy(module)
    precision = getattr(trainer, "precision_plugin", None)
    mask = _checked(input_ids, attention_mask, max_new_tokens)
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ()),
                        dtype=input_ids.dtype, device=input_ids.device)
    pad = pad_token_id if pad_token_id is not None else int(ends[0]) if len(ends) else 0
    tensor, (sequence_parallel, t) = _tensor_group(strategy), _sequence_split(strategy)
    staged = StagedForward(strategy.pipeline) if getattr(strategy, "pipeline", None) is not None else None
    rows, device = input_ids.shape[0], input_ids.device
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    ids, chosen_logprobs = input_ids, []
    steps = model_steps(model, input_ids, mask, sequence_parallel, t)
    training = model.training
    model.eval()  # no dropout while generating
    try:
        for _ in range(max_new_tokens):
            signature = steps.begin()
            with precision.forward_context() if precision is not None else contextlib.nullcontext():
                # [b, v] float32; under pipeline parallelism on the last stage's rank only
                logits = steps.forward() if staged is None else staged(steps.forward, signature)
            token = logprob = None
            if logits is not None:
                token = choice.pick(logits, generator)
                if tensor is not None:
                    tensor.broadcast(token, 0)
                token = torch.where(done, torch.full_like(token, pad), token)
                logprob = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
            if staged is not None:
                token, logprob = staged.share(token, logprob, rows, device)
            assert token is not None and logprob is not None
            if return_logprobs:
                chosen_logprobs.append(logprob)
            steps.advance(token, staged)
            ids = torch.cat([ids, token[:, None]], dim=1)
            done = done | torch.isin(token, ends)
            if len(ends) and _everyone_done(done):
                break
    finally:
        model.train(training)
    if not return_logprobs:
        return ids
    logprobs = torch.stack(chosen_logprobs, dim=1) if chosen_logprobs else ids.new_zeros(ids.shape[0], 0,
                                                                                         dtype=torch.float32)
    return ids, logprobs


def _model_and_strategy(module: Any) -> tuple[Any, Any, Any]:
    """The causal LM, the trainer of a LightningModule (``None`` for a bare model), and under ``SeqParallelStrategy``
    the strategy (``None`` otherwise).

    Raises:
        NotImplementedError: context parallelism.
    """
    lightning_module = any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)
    model = _causal_lm(module) if lightning_module else module  # (a causal LM's own `model` is its base, not it)
    trainer = getattr(module, "_trainer", None) if lightning_module else None
    strategy = getattr(trainer, "strategy", None)
    layout = getattr(strategy, "layout", None)
    if layout is None:
        return model, trainer, None
    if layout.cp > 1:
        raise NotImplementedError(f"generate() under context parallelism (cp={layout.cp}) is not implemented: decoding "
                                  f"one position at a time has no sequence to split. Generate at cp=1.")
    return model, trainer, strategy


def _causal_lm(module: Any) -> Any:
    """The LightningModule's causal LM: its ``model`` (a Hugging Face model), or the reference GPT's ``gpt``.

    Raises:
        TypeError: a module with neither, naming where the model is expected.
    """
    for name in ("model", "gpt"):
        if isinstance(getattr(module, name, None), torch.nn.Module):
            return getattr(module, name)
    raise TypeError(f"generate() looks for the causal LM of {type(module).__name__} at .model (a Hugging Face model) "
                    f"or .gpt (the reference GPT); pass the model itself: generate(module.my_model, ...).")


def _checked(input_ids: Tensor, attention_mask: Optional[Tensor], max_new_tokens: int) -> Tensor:
    """The attention mask (ones where none is given), once the arguments are what :func:`generate` takes."""
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}: token ids [b, s] "
                         f"with s >= 1 (tokenizer(..., return_tensors='pt').input_ids).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: a number of tokens, 0 or more.")
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} for input_ids of shape "
                         f"{tuple(input_ids.shape)}: one entry per token.")
    mask = attention_mask.to(input_ids.dtype)
    if bool(((mask[:, 1:] - mask[:, :-1]) < 0).any()) or bool((mask[:, -1] == 0).any()):
        raise ValueError("attention_mask pads a prompt on the right (or within it): generation continues each row "
                         "after its last token, so pad on the left (tokenizer.padding_side = 'left').")
    return mask


def _tensor_group(strategy: Any) -> Any:
    """The tensor-parallel group the token is broadcast over (``None``: none)."""
    if strategy is None:
        return None
    group = strategy.mesh.tensor
    return group if group.size > 1 else None


def _sequence_split(strategy: Any) -> tuple[bool, int]:
    """Whether the layout runs sequence parallelism, and t."""
    if strategy is None:
        return False, 1
    return bool(strategy.layout.sequence_parallel), strategy.layout.tp


def _everyone_done(done: Tensor) -> bool:
    """Whether every row of every replica has ended (one host read per token: every rank runs as many forwards)."""
    left = (~done).any().to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(left, op=dist.ReduceOp.MAX)
    return not bool(left)
