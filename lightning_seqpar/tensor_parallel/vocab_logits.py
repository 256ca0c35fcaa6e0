"""Logits split over the vocabulary that look whole to the code reading them.

A vocabulary-parallel LM head leaves each rank the columns ``[..., v'/t]`` of its vocabulary shard. The loss
is computed on them directly (:func:`~lightning_seqpar.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`),
so the full ``[b, s, v]`` logits never exist. But a model's output still carries ``.logits``, and code written for
one device may read it: :class:`VocabShardedLogits` reports the single-device shape, and the first operation on it
gathers the vocabulary (f̄'s conjugate: all-gather forward, this rank's columns backward), padding cut, once; from
then on it is the single-device tensor, gradients included. Elementwise operations with a number and ``tanh`` (a
final-logit soft-cap, ``cap · tanh(logits / cap)``, or a logit scale) are applied to the shard and stay sharded, so
the loss after them is still computed on the shards. Nobody receives a sharded tensor by surprise; the
gather costs ``b·s·v`` elements per rank, only when the logits are used.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import gather_from_tensor_parallel_region

# Read without gathering: what a shard and the whole tensor share.
_SAME_AS_LOCAL = {torch.Tensor.dtype, torch.Tensor.device, torch.Tensor.requires_grad, torch.Tensor.grad_fn,
                  torch.Tensor.is_leaf, torch.Tensor.layout, torch.Tensor.ndim}

# Elementwise with a number: applied to the shard, the result still sharded (final-logit soft-capping,
# ``cap · tanh(logits / cap)``, and logit scales keep the loss vocabulary-parallel).
_ELEMENTWISE_WITH_NUMBER = {torch.Tensor.__truediv__, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.div,
                            torch.Tensor.mul, torch.div, torch.mul}
_ELEMENTWISE = {torch.tanh, torch.Tensor.tanh}


class VocabShardedLogits(torch.Tensor):
    """This rank's vocabulary columns ``[..., v'/t]`` of logits whose single-device shape is ``[..., v]``.

    Logits may also be *pending* (:meth:`pending`): the head's input and the head, not yet applied. A vocabulary-parallel
    loss then computes them a chunk of the sequence at a time (:meth:`over_chunks`), so at most one chunk's
    ``[b, chunk, v'/t]`` exists in forward or backward; anything else that reads them computes them whole, once.

    Attributes:
        local_shard: the shard, a plain tensor (what a vocabulary-parallel loss takes); computed when first read if
            pending.
        group: the tensor-parallel group the vocabulary is split over.
        vocab_size: v, the single-device vocabulary (columns past it are padding).
        chunk: positions of dim 1 per chunk of a pending computation (``None``: computed whole).
    """

    group: ParallelGroup
    vocab_size: int
    full: Optional[Tensor]
    chunk: Optional[int]

    @staticmethod
    def wrap(local: Tensor, group: ParallelGroup, vocab_size: int) -> "VocabShardedLogits":
        """``local`` ``[..., v'/t]`` as logits that read as ``[..., v]``."""
        logits = local.as_subclass(VocabShardedLogits)
        logits._local, logits.group, logits.vocab_size, logits.full = local, group, vocab_size, None
        logits._head, logits._input, logits._ops, logits.chunk = None, None, (), None
        return logits

    @staticmethod
    def pending(head: Callable[[Tensor], Tensor], x: Tensor, group: ParallelGroup, vocab_size: int, chunk: int,
                ops: tuple = ()) -> "VocabShardedLogits":
        """The logits ``head(x)`` (``x`` ``[b, s, h]`` → ``[b, s, v'/t]``), followed by ``ops`` (elementwise
        ``(function, arguments)``), not computed yet; a loss takes them ``chunk`` positions of dim 1 at a time."""
        logits = x.new_empty(0).as_subclass(VocabShardedLogits)
        logits._local, logits.group, logits.vocab_size, logits.full = None, group, vocab_size, None
        logits._head, logits._input, logits._ops, logits.chunk = head, x, ops, chunk
        return logits

    @property
    def local_shard(self) -> Tensor:
        if self._local is None:
            self._local = self._compute(self._input)
        return self._local

    def _compute(self, x: Tensor) -> Tensor:
        out = self._head(x)
        for func, args in self._ops:
            out = func(out, *args)
        return out

    def over_chunks(self, loss_of: Callable[[Tensor, slice], Tensor]) -> Tensor:
        """``Σ loss_of(local logits of positions rows, rows)`` over chunks of dim 1: for pending logits of more than
        one chunk, each chunk's logits are computed inside ``torch.utils.checkpoint`` (kept: only the head's input),
        so forward holds one chunk's logits at a time and backward recomputes each; otherwise the logits whole."""
        if self._local is not None or self.chunk is None or self._input.shape[1] <= self.chunk:
            return loss_of(self.local_shard, slice(None))
        total = None
        for start in range(0, self._input.shape[1], self.chunk):
            rows = slice(start, start + self.chunk)
            part = torch.utils.checkpoint.checkpoint(lambda x, rows=rows: loss_of(self._compute(x), rows),
                                                     self._input[:, rows], use_reentrant=False)
            total = part if total is None else total + part
        return total

    def gathered(self) -> Tensor:
        """The single-device logits ``[..., v]`` (gathered once, differentiable)."""
        if self.full is None:
            self.full = gather_from_tensor_parallel_region(self.local_shard, self.group)[..., : self.vocab_size]
        return self.full

    def global_shape(self) -> torch.Size:
        leading = self._input.shape[:-1] if self._local is None else self.local_shard.shape[:-1]
        return torch.Size((*leading, self.vocab_size))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        descriptor = getattr(func, "__self__", None)
        if args and isinstance(args[0], VocabShardedLogits):
            this = args[0]
            if descriptor is torch.Tensor.shape or func is torch.Tensor.size:
                shape = this.global_shape()
                return shape if descriptor is torch.Tensor.shape or len(args) == 1 else shape[args[1]]
            if func is torch.Tensor.dim:
                return this.local_shard.dim()
            if descriptor in _SAME_AS_LOCAL:
                return func(this.local_shard)
            if this.full is None and not kwargs and (
                    (func in _ELEMENTWISE and len(args) == 1)
                    or (func in _ELEMENTWISE_WITH_NUMBER and len(args) == 2 and isinstance(args[1], (int, float))
                        and not isinstance(args[1], bool))):
                if this._local is None:  # still pending: the operation joins the computation
                    return VocabShardedLogits.pending(this._head, this._input, this.group, this.vocab_size, this.chunk,
                                                      this._ops + ((func, args[1:]),))
                return VocabShardedLogits.wrap(func(this.local_shard, *args[1:]), this.group, this.vocab_size)
        unwrapped = [a.gathered() if isinstance(a, VocabShardedLogits) else a for a in args]
        unwrapped_kwargs = {k: v.gathered() if isinstance(v, VocabShardedLogits) else v for k, v in kwargs.items()}
        return func(*unwrapped, **unwrapped_kwargs)
