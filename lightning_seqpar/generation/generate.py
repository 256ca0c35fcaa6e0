"""Text out of a model in the layout it trains in: every rank of the run calls :func:`generate` together, and each
data-parallel replica continues its own batch of prompts, no rank ever holding more of the model than it trains with.

Each new token runs the model's forward over the sequence so far, as training runs it (tensor and sequence
parallelism, experts over ep and expert_tp; the trainer's precision, autocast under ``bf16-mixed``); the logits of the
last position are gathered over the vocabulary's tensor-parallel split, and the token is chosen as transformers'
``generate`` chooses it (:mod:`.next_token`). A draw is made by every rank from the same generator state and
tensor-parallel rank 0's token is broadcast, so the ranks of a tensor-parallel group cannot disagree where a kernel's
rounding differs between devices. Rows stop at their
end-of-sequence token; every rank runs the same number of forwards (a mixture's dispatch spans the data-parallel
replicas), so the loop ends when every replica's rows have stopped.

Not yet: a key/value cache (each token recomputes the prefix: ``O(n²)``), pipeline and context parallelism (refused
by name).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.generation.next_token import TokenChoice


@torch.no_grad()
def generate(module: Any, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Optional[Tensor] = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             return_logprobs: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Continue ``input_ids`` ``[b, s]`` (this data-parallel replica's prompts, left-padded where ``attention_mask``
    ``[b, s]`` has zeros) by up to ``max_new_tokens`` tokens. Collective: every rank of the run calls it, the ranks of
    a tensor-parallel group with the same prompts.

    Args:
        module: a LightningModule trained by ``SeqParallelStrategy`` whose ``model`` is the causal LM (a Hugging Face
            model, PEFT-wrapped or not, called as ``model(input_ids=, attention_mask=, position_ids=)``), or such a
            model itself on one process.
        do_sample, temperature, top_k, top_p: how each token is chosen (:class:`~.next_token.TokenChoice`).
        generator: the draws' generator (the same seed on every rank: the draw is broadcast from tensor-parallel
            rank 0 all the same).
        eos_token_id: the token (or tokens) that ends a row; the row is padded with ``pad_token_id`` after it
            (default: the first end-of-sequence token, else 0).
        return_logprobs: also return the chosen tokens' log-probabilities ``[b, n]`` (float32) under the model's
            distribution (the unprocessed logits: what the training forward gives the same tokens).

    Returns:
        ``[b, s + n]`` token ids, ``n ≤ max_new_tokens`` (fewer when every row of every replica has ended); and, asked,
        the log-probabilities ``[b, n]``.

    Raises:
        ValueError: a prompt that is not ``[b, s]`` integer ids, a mask of another shape or padded on the right, a
            negative ``max_new_tokens``, sampling settings out of range; naming the value and the fix.
        NotImplementedError: pipeline or context parallelism, naming what to do instead.
    """
    choice = TokenChoice(do_sample, temperature, top_k, top_p)
    model, trainer, strategy = _model_and_strategy(module)
    precision = getattr(trainer, "precision_plugin", None)
    mask = _checked(input_ids, attention_mask, max_new_tokens)
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ()),
                        dtype=input_ids.dtype, device=input_ids.device)
    pad = pad_token_id if pad_token_id is not None else int(ends[0]) if len(ends) else 0
    tensor, multiple = _tensor_group(strategy)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    ids, chosen_logprobs = input_ids, []
    training = model.training
    model.eval()  # no dropout while generating
    try:
        for _ in range(max_new_tokens):
            with precision.forward_context() if precision is not None else contextlib.nullcontext():
                logits = _last_logits(model, ids, mask, pad, multiple)  # [b, v], float32: as training computes it
            token = choice.pick(logits, generator)
            if tensor is not None:
                tensor.broadcast(token, 0)
            token = torch.where(done, torch.full_like(token, pad), token)
            if return_logprobs:
                chosen_logprobs.append(logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
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
        NotImplementedError: pipeline or context parallelism.
    """
    lightning_module = any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)
    model = module.model if lightning_module else module  # (a causal LM's own `model` is its base, not it)
    trainer = getattr(module, "_trainer", None) if lightning_module else None
    strategy = getattr(trainer, "strategy", None)
    layout = getattr(strategy, "layout", None)
    if layout is None:
        return model, trainer, None
    if layout.pp > 1:
        raise NotImplementedError(f"generate() under pipeline parallelism (pp={layout.pp}) is not implemented yet: "
                                  f"generate from a run of the same model at pp=1 (its checkpoint resumes there).")
    if layout.cp > 1:
        raise NotImplementedError(f"generate() under context parallelism (cp={layout.cp}) is not implemented: decoding "
                                  f"one position at a time has no sequence to split. Generate at cp=1.")
    return model, trainer, strategy


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


def _tensor_group(strategy: Any) -> tuple[Any, int]:
    """The tensor-parallel group the token is broadcast over (``None``: none), and the multiple the sequence is padded
    to (t under sequence parallelism, which splits it over the t ranks)."""
    if strategy is None:
        return None, 1
    group = strategy.mesh.tensor
    return (group if group.size > 1 else None), (group.size if strategy.layout.sequence_parallel else 1)


def _last_logits(model: Any, ids: Tensor, mask: Tensor, pad: int, multiple: int) -> Tensor:
    """The logits ``[b, v]`` (float32) at the last position of ``ids``: the forward over the whole sequence, padded on
    the right to a multiple of ``multiple`` (causal: the positions after it change nothing before it), positions
    counted over the mask as transformers' ``generate`` counts them."""
    length = ids.shape[1]
    extra = -length % multiple
    x, m = F.pad(ids, (0, extra), value=pad), F.pad(mask, (0, extra), value=0)
    positions = (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
    logits = model(input_ids=x, attention_mask=m, position_ids=positions, use_cache=False).logits
    return logits[:, length - 1].float()


def _everyone_done(done: Tensor) -> bool:
    """Whether every row of every replica has ended (one host read per token: every rank runs as many forwards)."""
    left = (~done).any().to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(left, op=dist.ReduceOp.MAX)
    return not bool(left)
