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

from typing import Any, Optional

import torch
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

    Attributes:
        local_shard: the shard, a plain tensor (what a vocabulary-parallel loss takes).
        group: the tensor-parallel group the vocabulary is split over.
        vocab_size: v, the single-device vocabulary (columns past it are padding).
    """

    local_shard: Tensor
    group: ParallelGroup
    vocab_size: int
    full: Optional[Tensor]

    @staticmethod
    def wrap(local: Tensor, group: ParallelGroup, vocab_size: int) -> "VocabShardedLogits":
        """``local`` ``[..., v'/t]`` as logits that read as ``[..., v]``."""
        logits = local.as_subclass(VocabShardedLogits)
        logits.local_shard, logits.group, logits.vocab_size, logits.full = local, group, vocab_size, None
        return logits

    def gathered(self) -> Tensor:
        """The single-device logits ``[..., v]`` (gathered once, differentiable)."""
        if self.full is None:
            self.full = gather_from_tensor_parallel_region(self.local_shard, self.group)[..., : self.vocab_size]
        return self.full

    def global_shape(self) -> torch.Size:
        return torch.Size((*self.local_shard.shape[:-1], self.vocab_size))

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
                return VocabShardedLogits.wrap(func(this.local_shard, *args[1:]), this.group, this.vocab_size)
        unwrapped = [a.gathered() if isinstance(a, VocabShardedLogits) else a for a in args]
        unwrapped_kwargs = {k: v.gathered() if isinstance(v, VocabShardedLogits) else v for k, v in kwargs.items()}
        return func(*unwrapped, **unwrapped_kwargs)
