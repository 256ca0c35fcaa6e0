"""Attention computed block by block: queries of one chunk against keys of one chunk, merged by log-sum-exp.

The forward keeps, per query row, the running output and the log-sum-exp of its scores; a new block's partial
result joins them as ``out = out·e^(lse−lse') + out_blk·e^(lse_blk−lse')`` with ``lse' = log(e^lse + e^lse_blk)``
(Milakov & Gimelshein's online softmax; Liu et al., *Ring Attention*, 2023). The backward recomputes each block's
probabilities from the final log-sum-exp (FlashAttention-2's backward, Dao 2023):
``dS = P ∘ (dP − rowsum(dO ∘ O))``, so nothing of size ``n × n`` is kept between forward and backward.

Shapes (local to one call): q ``[b, a, m·n, d]`` holding ``m`` chunks of ``n`` tokens, k and v ``[b, a_kv, m'·n, d]``
(grouped-query attention: each key/value head serves ``a / a_kv`` query heads, expanded per block). Scores,
softmax and accumulators are in float32 (or float64 for float64 inputs).

A block is computed either op by op (the explicit core attention: scores, mask, log-sum-exp, ``· V``) or, with
``fused``, by a fused kernel that returns the log-sum-exp (``_compat.fused_attention_with_lse``: SDPA's flash kernel
on CPU, its memory-efficient kernel on CUDA) and its backward given the final output and log-sum-exp; a query with no
key to see in a masked block gets ``lse = -inf`` either way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_seqpar._compat import fused_attention_backward, fused_attention_with_lse
from lightning_seqpar.context_parallel.layout import ContextParallelBatch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs (as fused kernels accumulate), the input's dtype when wider."""
    return torch.promote_types(dtype, torch.float32)


def _expand(kv: Tensor, heads: int) -> Tensor:
    groups = heads // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: Tensor, kv_heads: int) -> Tensor:
    """A gradient over expanded heads ``[b, a, n, d]`` summed back onto the ``a_kv`` key/value heads."""
    b, a, n, d = grad.shape
    return grad if a == kv_heads else grad.view(b, kv_heads, a // kv_heads, n, d).sum(2)


def _scores(q: Tensor, k: Tensor, scale: float, softcap: Optional[float], allowed: Optional[Tensor]
            ) -> tuple[Tensor, Optional[Tensor]]:
    """Scaled (soft-capped, masked) scores ``[b, a, n, n]`` and the capped values' ``tanh`` (for backward)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores, capped


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (a row with no key to see) as 0, so ``exp(score − lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused_inputs(layout: ContextParallelBatch, qc: int, kc: int, allowed: Optional[Tensor]
                  ) -> tuple[bool, Optional[Tensor]]:
    """``(is_causal, mask)`` of a block for the fused kernel: a diagonal block with nothing but causality is the
    kernel's own causal case; any other mask goes in as the block's ``allowed`` mask."""
    if qc == kc and layout.documents is None and layout.padding is None and layout.window is None:
        return True, None
    return False, allowed


def attend(q: Tensor, q_chunks: Sequence[int], k: Tensor, v: Tensor, k_chunks: Sequence[int],
           layout: ContextParallelBatch, scale: float, softcap: Optional[float], out: list[Tensor],
           lse: list[Tensor], fused: bool = False) -> None:
    """Add every visible block of ``q`` (chunks ``q_chunks``) against ``k``/``v`` (chunks ``k_chunks``) into the
    accumulators ``out[i]`` ``[b, a, n, d]`` and ``lse[i]`` ``[b, a, n]`` of query chunk ``i``, in place."""
    n, heads, acc = layout.chunk, q.shape[1], out[0].dtype
    for i, qc in enumerate(q_chunks):
        q_blk = q[:, :, i * n:(i + 1) * n]
        for j, kc in enumerate(k_chunks):
            kind, allowed = layout.block_mask(qc, kc, q.device)
            if kind == "skip":
                continue
            k_blk = _expand(k[:, :, j * n:(j + 1) * n], heads)
            v_blk = _expand(v[:, :, j * n:(j + 1) * n], heads)
            if fused:
                causal, mask = _fused_inputs(layout, qc, kc, allowed)
                blk_out, blk_lse = fused_attention_with_lse(q_blk, k_blk, v_blk, causal, mask, scale)
                blk_out, blk_lse = blk_out.to(acc), blk_lse.to(acc)
                if mask is not None:  # a query that sees nothing gets a finite lse from the kernel: it has no weight
                    blk_lse = blk_lse.masked_fill(~allowed.any(-1)[:, None], float("-inf"))
            else:
                scores, _ = _scores(q_blk.to(acc), k_blk.to(acc), scale, softcap, allowed)
                blk_lse = torch.logsumexp(scores, dim=-1)  # [b, a, n]
                blk_out = torch.matmul(torch.exp(scores - _finite(blk_lse)[..., None]), v_blk.to(acc))
            merged = torch.logaddexp(lse[i], blk_lse)
            safe = _finite(merged)
            out[i] = out[i] * torch.exp(lse[i] - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
            lse[i] = merged


def attend_backward(q: Tensor, q_chunks: Sequence[int], k: Tensor, v: Tensor, k_chunks: Sequence[int],
                    layout: ContextParallelBatch, scale: float, softcap: Optional[float], d_out: Tensor, lse: Tensor,
                    delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, fused: Optional[tuple[Tensor, Tensor]] = None
                    ) -> None:
    """The gradients of :func:`attend`'s blocks, added in place: ``dq`` ``[b, a, m·n, d]`` for ``q``, ``dk``/``dv``
    ``[b, a_kv, m'·n, d]`` for ``k``/``v``. ``d_out`` ``[b, a, m·n, d]``, ``lse`` ``[b, a, m·n]`` (the final
    log-sum-exp of each query) and ``delta = rowsum(d_out ∘ out)`` ``[b, a, m·n]``, all in the accumulation dtype.
    ``fused``: the output and its gradient in q's dtype, for the fused kernel's backward (``None``: op by op)."""
    n, heads, kv_heads, acc = layout.chunk, q.shape[1], k.shape[1], dq.dtype
    for i, qc in enumerate(q_chunks):
        rows = slice(i * n, (i + 1) * n)
        q_blk, do_blk = q[:, :, rows].to(acc), d_out[:, :, rows]
        lse_blk, delta_blk = _finite(lse[:, :, rows])[..., None], delta[:, :, rows][..., None]
        for j, kc in enumerate(k_chunks):
            kind, allowed = layout.block_mask(qc, kc, q.device)
            if kind == "skip":
                continue
            cols = slice(j * n, (j + 1) * n)
            if fused is not None:
                out, d_out_native = fused
                causal, mask = _fused_inputs(layout, qc, kc, allowed)
                k_blk, v_blk = _expand(k[:, :, cols], heads), _expand(v[:, :, cols], heads)
                d_q, d_k, d_v = fused_attention_backward(
                    d_out_native[:, :, rows], q[:, :, rows], k_blk, v_blk, out[:, :, rows],
                    lse_blk[..., 0].to(lse.dtype), causal, mask, scale)
                dq[:, :, rows] += d_q.to(acc)
                dk[:, :, cols] += _fold(d_k.to(acc), kv_heads)
                dv[:, :, cols] += _fold(d_v.to(acc), kv_heads)
                continue
            k_blk = _expand(k[:, :, cols], heads).to(acc)
            v_blk = _expand(v[:, :, cols], heads).to(acc)
            scores, capped = _scores(q_blk, k_blk, scale, softcap, allowed)
            probs = torch.exp(scores - lse_blk)  # masked entries: exp(-inf) = 0
            dv[:, :, cols] += _fold(torch.matmul(probs.transpose(-2, -1), do_blk), kv_heads)
            d_scores = probs * (torch.matmul(do_blk, v_blk.transpose(-2, -1)) - delta_blk)
            if capped is not None:
                d_scores = d_scores * (1 - capped * capped)
            dq[:, :, rows] += torch.matmul(d_scores, k_blk) * scale
            dk[:, :, cols] += _fold(torch.matmul(d_scores.transpose(-2, -1), q_blk), kv_heads) * scale
