"""Cross entropy over vocabulary-sharded logits (Megatron-LM ``vocab_parallel_cross_entropy``).

The logits never exist whole on one rank: the softmax normalizer, the target logit and (for label
smoothing) the mean logit are partial sums over the vocabulary shards, combined by all-reduces. Padding
columns (vocabulary padded to a multiple of t) are excluded, and label smoothing spreads ε over
the *global, unpadded* vocabulary v, so the result equals
``F.cross_entropy(full_logits[..., :v], target, label_smoothing=ε)`` for any t.

One autograd function, as Megatron-LM and torchtitan write it: forward keeps a single float32 ``[..., v'/t]``
tensor for backward (this rank's softmax), and backward is ``softmax − (1−ε)·onehot − ε/v`` with no
communication. Three all-reduces forward (max, sum of exponentials, target logit; a fourth, the logit sum, with
label smoothing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-target loss ``[...]`` of local logits ``[..., v'/t]`` (0 where the target is ignored)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, group: ParallelGroup, vocab_size: int,
                label_smoothing: float, ignore_index: int) -> Tensor:
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        columns = torch.arange(start, start + per_rank, device=logits.device)
        valid = columns < vocab_size  # [v'/t]: padding columns take no part
        logits = logits.float() if logits.element_size() < 4 else logits
        local_max = logits.masked_fill(~valid, float("-inf")).amax(dim=-1)
        global_max = group.all_reduce(local_max, op=dist.ReduceOp.MAX)  # [...]
        softmax = (logits - global_max.unsqueeze(-1)).masked_fill_(~valid, float("-inf"))  # [..., v'/t] shifted
        ignored = target == ignore_index
        local_target = target - start
        mine = (local_target >= 0) & (local_target < per_rank) & ~ignored
        index = local_target.clamp(0, per_rank - 1).unsqueeze(-1)
        target_logit = group.all_reduce(softmax.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0))
        logit_sum = None
        if label_smoothing > 0:
            logit_sum = group.all_reduce(softmax.masked_fill(~valid, 0.0).sum(dim=-1))
        softmax.exp_()  # in place: the one [..., v'/t] tensor kept
        sum_exp = group.all_reduce(softmax.sum(dim=-1))
        log_normalizer = sum_exp.log()
        loss = log_normalizer - target_logit
        if logit_sum is not None:
            smooth = log_normalizer - logit_sum / vocab_size  # mean over v of −log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, ignored, valid)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple:
        softmax, index, mine, ignored, valid = ctx.saved_tensors
        grad = softmax.clone()  # a second backward (retain_graph) must find the softmax intact
        grad.scatter_add_(-1, index, -(1.0 - ctx.label_smoothing) * mine.to(grad.dtype).unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad.sub_(valid.to(grad.dtype) * (ctx.label_smoothing / ctx.vocab_size))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: ParallelGroup,
    vocab_size: int,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Cross entropy of vocabulary-sharded logits.

    Args:
        logits: local shard ``[..., v'/t]`` of the padded vocabulary ``v' ≥ v`` (rank r holds columns
            ``[r·v'/t, (r+1)·v'/t)``); 16-bit logits are computed in float32.
        target: global class ids ``[...]``; entries equal to ``ignore_index`` do not count.
        vocab_size: the unpadded global vocabulary v (columns ≥ v are padding).
        label_smoothing: ε, spread uniformly over the v real classes.
        reduction: ``"mean"`` over non-ignored targets, ``"sum"``, or ``"none"`` (per target, 0 where ignored).

    Returns:
        The loss, identical on every rank of ``group``: a scalar, or ``[...]`` with ``reduction="none"``. Kept for
        backward: one float32 ``[..., v'/t]`` tensor (bytes: 4·numel(target)·v'/t).

    Raises:
        ValueError: if ``label_smoothing`` is outside ``[0, 1]``, or an unknown ``reduction``.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}.")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)


@torch.no_grad()
def vocab_parallel_entropy(logits: Tensor, group: ParallelGroup, vocab_size: int) -> Tensor:
    """The entropy ``−Σ p log p`` (nats) of each position's distribution over the whole vocabulary ``[...]``, from this
    rank's shard of the logits ``[..., v'/t]`` (columns ≥ v are padding), without gradients: a metric (GRPO's
    ``entropy``). ``H = log S − Σ (e/S)·z`` with ``z`` the logits less their global maximum, ``e = exp z`` and ``S =
    Σ e``: three all-reduces over ``[...]`` (a maximum, two sums), nothing of ``[..., v]`` gathered."""
    per_rank = logits.shape[-1]
    start = group.rank * per_rank
    valid = torch.arange(start, start + per_rank, device=logits.device) < vocab_size
    logits = logits.float() if logits.element_size() < 4 else logits
    peak = group.all_reduce(logits.masked_fill(~valid, float("-inf")).amax(dim=-1), op=dist.ReduceOp.MAX)
    shifted = (logits - peak.unsqueeze(-1)).masked_fill(~valid, float("-inf"))
    exps = shifted.exp()
    total = group.all_reduce(exps.sum(dim=-1))
    weighted = group.all_reduce((exps * shifted.masked_fill(~valid, 0.0)).sum(dim=-1))
    return total.log() - weighted / total
