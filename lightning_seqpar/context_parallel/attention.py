"""Core attention over a sequence split across the context-parallel group: ring or all-to-all.

- **Ring** (Liu et al., *Ring Attention*, 2023; Megatron-Core / Transformer Engine's ``AttnFuncWithCPAndKVP2P``):
  each rank keeps its queries; the key/value heads (only those: grouped-query attention sends ``a_kv``, not ``a``)
  travel around the cp ring in ``c − 1`` steps, the next block's transfer in flight while the current one is
  computed. Blocks a query cannot see (later chunks; outside a window) are skipped; partial outputs merge by
  log-sum-exp. Backward sends K/V around again with their gradient accumulators, which arrive home after ``c``
  steps (:func:`bytes_per_layer`).
- **All-to-all** (Jacobs et al., *DeepSpeed-Ulysses*, 2023): one all-to-all turns ``[b, a/t, s/c, d]`` into
  ``[b, a/(t·c), s, d]`` (heads scattered, sequence gathered) for q, k and v; attention runs on whole sequences;
  one all-to-all brings the output back. Local query and key/value heads must both divide by c.

Both compute attention block by block (:mod:`.blocks`): what is kept for backward is q, k, v, the output and the
log-sum-exp, never an ``s × s`` or ``n × n`` tensor, so selective recomputation has nothing further to drop.

Shapes: q ``[b, a/t, s/c, d]``, k/v ``[b, a_kv/t, s/c, d]`` holding this rank's chunks (:mod:`.layout`);
output ``[b, a/t, s/c, d]``.
"""

from __future__ import annotations

import contextlib

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_seqpar._compat import fused_attention_supported
from lightning_seqpar.context_parallel.blocks import accumulation_dtype, attend, attend_backward
from lightning_seqpar.context_parallel.layout import ContextParallelBatch


def _initial(q: Tensor, chunks: int, n: int) -> tuple[list[Tensor], list[Tensor]]:
    acc = accumulation_dtype(q.dtype)
    b, a, _, d = q.shape
    out = [q.new_zeros((b, a, n, d), dtype=acc) for _ in range(chunks)]
    lse = [q.new_full((b, a, n), float("-inf"), dtype=acc) for _ in range(chunks)]
    return out, lse


class _BlockwiseAttention(torch.autograd.Function):
    """Attention of ``q`` (chunks ``q_chunks``) against key/value sources: this rank's own and, on the ring, every
    other cp rank's in turn (``ring``); or one local source holding the same chunks as ``q`` (``ring=False``)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, layout: ContextParallelBatch, q_chunks: tuple[int, ...],
                ring: bool, scale: float, softcap: Optional[float], fused: bool, sinks: Optional[Tensor]) -> Tensor:
        n, group = layout.chunk, layout.group
        out, lse = _initial(q, len(q_chunks), n)
        steps = group.size if ring else 1
        kv = torch.stack([k, v]) if steps > 1 else None
        for step in range(steps):
            source_chunks = layout.chunks((group.rank - step) % group.size) if ring else q_chunks
            pending = group.ring_exchange_start(kv) if step < steps - 1 else None  # the next source, in flight
            key, value = (kv[0], kv[1]) if kv is not None else (k, v)
            attend(q, q_chunks, key, value, source_chunks, layout, scale, softcap, out, lse, fused)
            if pending is not None:
                kv = pending.wait()
        merged, normalizer = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        if sinks is not None:  # each head's sink logit joins every row's normalizer (and takes its share of the mass)
            normalizer = torch.logaddexp(normalizer, sinks.to(normalizer.dtype).view(1, -1, 1))
            merged = merged * torch.exp(torch.cat(lse, dim=2) - normalizer).unsqueeze(-1)
        result = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, normalizer, sinks)
        ctx.layout, ctx.q_chunks, ctx.ring, ctx.scale, ctx.softcap = layout, q_chunks, ring, scale, softcap
        ctx.fused = fused
        return result

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Optional[Tensor], ...]:
        with _without_autocast(d_out.device.type):  # float32 blocks, whatever encloses the backward
            return _BlockwiseAttention._backward(ctx, d_out)

    @staticmethod
    def _backward(ctx: Any, d_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, group = ctx.layout, ctx.layout.group
        acc = accumulation_dtype(q.dtype)
        native = (out, d_out.to(q.dtype).contiguous()) if ctx.fused else None
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1)
        # The sink's column has no value: its score's gradient is p_sink · (0 − delta), summed over rows.
        d_sinks = None if sinks is None else (-(torch.exp(sinks.to(acc).view(1, -1, 1) - lse) * delta)).sum((0, 2)).to(
            sinks.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        steps = group.size if ctx.ring else 1
        if steps == 1:  # one local source: no ring, nothing stacked
            d_k, d_v = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
            attend_backward(q, ctx.q_chunks, k, v, ctx.q_chunks, layout, ctx.scale, ctx.softcap, d_out, lse, delta,
                            dq, d_k, d_v, native)
            return dq.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None, None, None, None, None, d_sinks
        kv = torch.stack([k, v])
        # The gradient of the source held now travels with it in k's dtype (16-bit traffic under mixed precision, as
        # Transformer Engine sends it); each step's own contributions are summed in the accumulation dtype first.
        d_kv = torch.zeros_like(kv)
        for step in range(steps):
            source_chunks = layout.chunks((group.rank - step) % group.size)
            pending = group.ring_exchange_start(kv) if step < steps - 1 else None
            step_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            attend_backward(q, ctx.q_chunks, kv[0], kv[1], source_chunks, layout, ctx.scale, ctx.softcap, d_out, lse,
                            delta, dq, step_kv[0], step_kv[1], native)
            d_kv = d_kv + step_kv.to(kv.dtype)
            if steps > 1:  # the accumulator follows its source; after the last step it reaches the source's owner
                d_kv = group.ring_exchange_start(d_kv).wait()
            if pending is not None:
                kv = pending.wait()
        return dq.to(q.dtype), d_kv[0], d_kv[1], None, None, None, None, None, None, d_sinks


class _AllToAll(torch.autograd.Function):
    """``[b, a, S, d]`` with this rank's chunks → ``[b, a/c, s, d]`` in sequence order (heads scattered, sequence
    gathered), or back (``inverse``). Each is the other's backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layout: ContextParallelBatch, inverse: bool) -> Tensor:
        ctx.layout, ctx.inverse = layout, inverse
        return _scatter_heads(x, layout) if not inverse else _gather_heads(x, layout)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        layout = ctx.layout
        return (_gather_heads(grad, layout) if not ctx.inverse else _scatter_heads(grad, layout)), None, None


def _order(layout: ContextParallelBatch) -> list[int]:
    """Chunk ids in the order an all-to-all delivers them: rank 0's two, then rank 1's, ..."""
    return [chunk for r in range(layout.c) for chunk in layout.chunks(r)]


def _scatter_heads(x: Tensor, layout: ContextParallelBatch) -> Tensor:
    c, n = layout.c, layout.chunk
    b, a, _, d = x.shape
    sent = x.reshape(b, c, a // c, 2 * n, d).transpose(0, 1)  # [c (to), b, a/c, 2n, d]
    got = layout.group.all_to_all(sent)  # [c (from), b, a/c, 2n, d]
    by_chunk = got.view(c, b, a // c, 2, n, d).permute(1, 2, 0, 3, 4, 5).reshape(b, a // c, 2 * c, n, d)
    natural = torch.empty_like(by_chunk)
    natural[:, :, _order(layout)] = by_chunk  # chunk ids in delivery order → sequence order
    return natural.view(b, a // c, 2 * c * n, d)


def _gather_heads(x: Tensor, layout: ContextParallelBatch) -> Tensor:
    c, n = layout.c, layout.chunk
    b, h, _, d = x.shape
    by_chunk = x.view(b, h, 2 * c, n, d)[:, :, _order(layout)]  # [b, a/c, 2c (delivery order), n, d]
    sent = by_chunk.view(b, h, c, 2 * n, d).permute(2, 0, 1, 3, 4)  # [c (to), b, a/c, 2n, d]
    got = layout.group.all_to_all(sent)  # [c (from: head group), b, a/c, 2n, d]
    return got.transpose(0, 1).reshape(b, c * h, 2 * n, d)


def check_all_to_all_heads(heads: int, kv_heads: int, c: int, where: str) -> None:
    """Raise ``ValueError`` unless both local head counts divide by c (all-to-all attention scatters heads).

    Raises:
        ValueError: naming both numbers and the fixes.
    """
    if heads % c or kv_heads % c:
        raise ValueError(f"{where}: all-to-all context parallelism scatters heads over cp={c} ranks, but this rank has "
                         f"{heads} query heads and {kv_heads} key/value heads (after tp). Use cp_comm='ring', a cp "
                         f"that divides both, or a smaller tp. (Key/value heads are not replicated to make them fit.)")


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, layout: ContextParallelBatch, scale: float,
                               softcap: Optional[float] = None, fused: bool = False,
                               sinks: Optional[Tensor] = None) -> Tensor:
    """``softmax(softcap(q kᵀ · scale) + mask) · v`` for this rank's queries over the whole sequence (see the module
    docstring); the mask is causal, per document, without padding keys and within the window, as ``layout`` says.

    ``sinks``: a learned logit per head ``[a/t]`` in every row's softmax (gpt-oss), merged after the blocks: the
    normalizer becomes ``logaddexp(lse, sink)`` and the output is scaled by ``exp(lse − normalizer)``; under all-to-all
    each rank applies its head group's.

    Shapes: q ``[b, a/t, s/c, d]``, k/v ``[b, a_kv/t, s/c, d]``; returns ``[b, a/t, s/c, d]``. Under autocast, q, k
    and v are cast to its dtype first (the dtype its matmuls would use), so the ring and the all-to-all move 16-bit
    tensors, and the blocks run outside autocast, accumulating in float32.

    ``fused``: compute each block with a fused kernel that returns the log-sum-exp (SDPA's flash kernel on CPU, its
    memory-efficient kernel on CUDA) instead of op by op; with a soft-cap, or where no such kernel takes q (float64
    on CUDA, a head size not a multiple of 8), the blocks run op by op.

    Raises:
        ValueError: all-to-all with head counts that do not divide by c (:func:`check_all_to_all_heads`).
    """
    device = q.device.type
    autocasts = torch.amp.is_autocast_available(device)  # not the meta device (shape checks, the planner)
    if autocasts and torch.is_autocast_enabled(device):  # what the matmuls would take: 16-bit over the wire
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    fused = fused and softcap is None and fused_attention_supported(q)  # the fused kernels have no soft-cap
    with _without_autocast(device):  # the blocks accumulate in float32 (blocks.accumulation_dtype)
        return _attention(q, k, v, layout, scale, softcap, fused, sinks)


def _attention(q: Tensor, k: Tensor, v: Tensor, layout: ContextParallelBatch, scale: float,
               softcap: Optional[float], fused: bool, sinks: Optional[Tensor]) -> Tensor:
    if layout.comm == "ring" or layout.c == 1:
        return _BlockwiseAttention.apply(q, k, v, layout, layout.chunks(), True, scale, softcap, fused, sinks)
    check_all_to_all_heads(q.shape[1], k.shape[1], layout.c, "Context-parallel attention")
    q, k, v = (_AllToAll.apply(x, layout, False) for x in (q, k, v))
    every = tuple(range(2 * layout.c))
    if sinks is not None:  # heads scattered: this rank's head group (rank r holds group r)
        sinks = sinks.view(layout.c, -1)[layout.group.rank]
    out = _BlockwiseAttention.apply(q, k, v, layout, every, False, scale, softcap, fused, sinks)
    return _AllToAll.apply(out, layout, True)


def bytes_per_layer(comm: str, b: int, s: int, heads: int, kv_heads: int, head_dim: int, t: int, c: int,
                    element_size: int) -> dict[str, dict[str, int]]:
    """Bytes one rank sends per layer for context-parallel attention, forward and backward, by collective kind (what
    :class:`~lightning_seqpar.parallel.CommunicationLog` counts). ``heads``/``kv_heads``: a and a_kv (global); the
    rank holds ``a/t`` and ``a_kv/t`` of them over ``s/c`` tokens; ``element_size``: bytes of q/k/v's dtype.

    - ring: K and V of ``b · (a_kv/t) · (s/c) · d`` elements each travel ``c − 1`` hops forward; backward they travel
      again (``c − 1``) and their gradients ``c`` hops: ``"ring_send"`` ``(c−1)·2·kv`` forward, ``(2c−1)·2·kv``
      backward.
    - all-to-all: q, k, v before and the output after, each leaving ``(c−1)/c`` of its local tensor, forward and
      again backward: ``"all_to_all"`` ``2 · (c−1)/c · (2·q + 2·kv)``.
    """
    local_q = b * (heads // t) * (s // c) * head_dim * element_size
    local_kv = b * (kv_heads // t) * (s // c) * head_dim * element_size
    if comm == "ring":
        return {"forward": {"ring_send": (c - 1) * 2 * local_kv}, "backward": {"ring_send": (2 * c - 1) * 2 * local_kv}}
    one_way = 2 * ((c - 1) * local_q // c) + 2 * ((c - 1) * local_kv // c)
    return {"forward": {"all_to_all": one_way}, "backward": {"all_to_all": one_way}}


def _without_autocast(device: str) -> Any:
    """Autocast off for ``device`` (a device type without autocast, such as meta, has nothing to turn off)."""
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
