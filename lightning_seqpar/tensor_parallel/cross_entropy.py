"""Cross entropy over vocabulary-sharded logits (Megatron-LM ``vocab_parallel_cross_entropy``).

The logits never exist whole on one rank: the softmax normalizer, the target logit and (for label
smoothing) the mean logit are partial sums over the vocabulary shards, combined by f̄. Padding
columns (vocabulary padded to a multiple of t) are excluded, and label smoothing spreads ε over
the *global, unpadded* vocabulary v, so the result equals
``F.cross_entropy(full_logits[..., :v], target, label_smoothing=ε)`` for any t.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.mappings import reduce_from_tensor_parallel_region


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: ParallelGroup,
    vocab_size: int,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> Tensor:
    """Mean cross entropy of vocabulary-sharded logits.

    Args:
        logits: local shard ``[..., v'/t]`` of the padded vocabulary ``v' ≥ v`` (rank r holds columns
            ``[r·v'/t, (r+1)·v'/t)``); computed in float32 or wider.
        target: global class ids ``[...]``; entries equal to ``ignore_index`` do not count.
        vocab_size: the unpadded global vocabulary v (columns ≥ v are padding).
        label_smoothing: ε, spread uniformly over the v real classes.

    Returns:
        A scalar: the mean loss over non-ignored targets, identical on every rank of ``group``.

    Raises:
        ValueError: if ``label_smoothing`` is outside ``[0, 1]``.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}.")
    per_rank = logits.shape[-1]
    start = group.rank * per_rank
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    columns = torch.arange(start, start + per_rank, device=logits.device)
    valid = columns < vocab_size  # [v'/t]

    with torch.no_grad():
        local_max = logits.masked_fill(~valid, float("-inf")).amax(dim=-1)
        global_max = group.all_reduce(local_max, op=dist.ReduceOp.MAX)  # [...]
    shifted = (logits - global_max.unsqueeze(-1)).masked_fill(~valid, float("-inf"))  # [..., v'/t]

    sum_exp = reduce_from_tensor_parallel_region(shifted.exp().sum(dim=-1), group)  # [...]
    log_normalizer = sum_exp.log()

    ignored = target == ignore_index
    local_target = target - start
    mine = (local_target >= 0) & (local_target < per_rank) & ~ignored
    picked = shifted.gather(-1, local_target.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tensor_parallel_region(picked.masked_fill(~mine, 0.0), group)  # [...]
    loss = log_normalizer - target_logit

    if label_smoothing > 0:
        logit_sum = reduce_from_tensor_parallel_region(shifted.masked_fill(~valid, 0.0).sum(dim=-1), group)
        smooth = log_normalizer - logit_sum / vocab_size  # mean over v of -log p
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

    loss = loss.masked_fill(ignored, 0.0)
    return loss.sum() / (~ignored).sum().clamp(min=1)
