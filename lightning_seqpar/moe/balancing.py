"""The load-balancing loss of a mixture of experts whose tokens are split over ranks, as transformers computes it
(``output_router_logits=True``): the same value and gradient as one process.

transformers' causal LM adds ``router_aux_loss_coef × load_balancing_loss_func(router_logits, E, k, attention_mask)``
to its loss: the Switch Transformer's ``E · Σ_e T_e · P_e`` over the tokens of all layers pooled, with ``T_e`` the
fraction of (token, top-k) choices given to expert e and ``P_e`` the mean router probability of e (Fedus et al. 2021,
Eq. 4-6; ``modeling_qwen3_moe.load_balancing_loss_func``). Its router logits are recorded by transformers' hooks on
the router module, which the parallel block calls on this rank's tokens: each rank records only its own rows, in the
sequence-parallel order ``[s/t, b]``. So the parallel block marks the logits it produced (:class:`RouterTokens`) and
the model module's ``load_balancing_loss_func`` is wrapped (:mod:`lightning_seqpar.hf.moe_loss`; unmarked logits go to
the original), which calls :func:`parallel_load_balancing_loss`: the counts, probability sums and rows of this rank's tokens (masked as the model's ``attention_mask``
says, each row's own mask entry) are summed over the ranks that split the tokens (tp under sequence parallelism, and
the data-parallel and context-parallel replicas), so every rank holds the one-process value.

Gradient: the probability sums are summed over ranks with an identity backward, so each rank's gradient is its own
tokens' share of the one-process gradient; every gradient is then summed over the replicas and divided by d·c, so the
share is multiplied by d here and by c in the backward of the sum over context-parallel ranks, as each replica's own
loss is (a replica's mean loss is d times its share of the global mean); each cp rank's value is 1/c of the loss,
which that sum restores. Accumulated or pipelined micro-batches scale it as they scale the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup

MARK = "lightning_seqpar_router_tokens"
"""The attribute on a router-logits tensor the parallel block produced: its :class:`RouterTokens`."""


class StageCarrier(Protocol):
    """What the last pipeline stage's router losses read from the carrier of the earlier stages' statistics
    (:class:`~lightning_seqpar.moe.pipeline_losses.StageRouterLosses`)."""

    upstream: Any  # the RouterStatistics received for the running forward, or None

    def consumed(self, totals: Any, pooled: bool = False) -> None:
        """Record the statistics the loss used (sent back to the earlier stages)."""


@dataclass(frozen=True)
class RouterTokens:
    """Where the rows of one rank's router logits come from.

    Attributes:
        groups: the groups whose ranks hold other tokens of the same batch (tp under sequence parallelism; the
            data-parallel and context-parallel replicas, ``dp_cp``).
        data_parallel: d, the data-parallel replicas (each its own loss; every gradient is divided by d·c).
        context_parallel: c, the context-parallel ranks, whose losses are summed after the forward
            (:func:`~lightning_seqpar.context_parallel.loss.sum_over_context`, its backward times c).
        rows_of: the model's ``attention_mask`` ``[b, s]`` → this rank's rows' entries ``[n]``, in the logits' order.
        stages: under pipeline parallelism, the carrier of the earlier stages' router statistics
            (:class:`~lightning_seqpar.moe.pipeline_losses.StageRouterLosses`); ``None`` without.
    """

    groups: tuple[ParallelGroup, ...]
    data_parallel: int
    context_parallel: int
    rows_of: Callable[[Tensor], Tensor]
    stages: Optional["StageCarrier"] = None


@dataclass(frozen=True)
class SequenceParallelRows:
    """``[b, s]`` → this rank's ``[s/t·b]`` rows (``[s, b]`` order inside the parallel region; ``s/t`` of them under
    sequence parallelism). A value, not a closure: a model holding it pickles."""

    group: ParallelGroup
    sequence_parallel: bool

    def __call__(self, mask: Tensor) -> Tensor:
        by_position = mask.t()
        if self.sequence_parallel and self.group.size > 1:
            by_position = by_position.chunk(self.group.size)[self.group.rank]
        return by_position.reshape(-1)


@dataclass(frozen=True)
class UnmaskableRows:
    """Rows that a ``[b, s]`` mask cannot be read for (context parallelism's chunks): refused when a mask is given.

    Raises:
        NotImplementedError: when called, naming the fix.
    """

    def __call__(self, mask: Tensor) -> Tensor:
        raise NotImplementedError("A load-balancing loss over an attention mask under context parallelism is not "
                                  "implemented (each rank's rows are chunks of the sequence): train without the mask "
                                  "(packed documents), or with cp=1.")


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over ``groups``; backward: the identity (each rank's share of the gradient is its own)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, groups: Sequence[ParallelGroup]) -> Tensor:
        total = tensor.clone()
        for group in groups:
            total = group.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def parallel_load_balancing_loss(gate_logits: tuple[Tensor, ...], num_experts: int, top_k: int,
                                 attention_mask: Optional[Tensor], tokens: RouterTokens,
                                 per_layer: bool = False) -> Tensor:
    """transformers' ``load_balancing_loss_func`` over every rank's tokens (see the module docstring): a scalar whose
    value is the one-process loss and whose gradient on this rank's logits is d·c times their share.

    ``per_layer``: the Switch Transformer's loss of each layer summed over the layers, ``Σ_l E · Σ_e T_e^l · P_e^l``
    (Megatron-Core's ``switch_load_balancing_loss_func`` per layer, over every rank's tokens of the step), instead of
    one loss of the counts and probabilities pooled over the layers.

    On the last pipeline stage (``tokens.stages``, :mod:`~lightning_seqpar.moe.pipeline_losses`) the statistics of the
    earlier stages' layers, received with the activation, join this stage's: the value is the one-process loss of
    every layer, and the gradient on this stage's logits is theirs in it.

    No host synchronisation: the counts are scatter-adds, the row count stays a tensor.
    """
    upstream = tokens.stages.upstream if tokens.stages is not None else None
    if per_layer:
        loss = per_layer_balancing(gate_logits, num_experts, top_k, attention_mask, tokens)
        if upstream is not None:
            loss = loss + upstream.per_layer
            tokens.stages.consumed(upstream)
        return as_replica_loss(loss, tokens)
    counts, probabilities, rows = router_statistics(gate_logits, num_experts, top_k, attention_mask, tokens)
    if upstream is None:
        return as_replica_loss(pooled_balancing(counts, probabilities, rows, num_experts), tokens)
    totals = upstream.joined(counts, probabilities.detach(), rows)
    tokens.stages.consumed(totals, pooled=True)
    own = pooled_balancing(totals.counts, probabilities, totals.rows, num_experts)  # its gradient: this stage's share
    value = pooled_balancing(totals.counts, totals.probabilities, totals.rows, num_experts)
    return as_replica_loss(value + (own - own.detach()), tokens)


def router_statistics(gate_logits: Sequence[Tensor], num_experts: int, top_k: int, attention_mask: Optional[Tensor],
                      tokens: RouterTokens) -> tuple[Tensor, Tensor, Tensor]:
    """The pooled statistics of ``gate_logits`` (one ``[n, E]`` per layer) over every rank's tokens: the (token,
    top-k) choices per expert ``[E]`` and the rows ``[]`` (summed over ``tokens.groups``, no gradient), and the
    router probabilities summed per expert ``[E]`` (summed over the groups with an identity backward: this rank's
    share of the gradient). float32."""
    counts, probabilities, rows = _layer_statistics(gate_logits, num_experts, top_k, attention_mask, tokens)
    return _reduced(counts.sum(0), probabilities.sum(0), rows.sum(0), tokens)


def pooled_balancing(counts: Tensor, probabilities: Tensor, rows: Tensor, num_experts: int) -> Tensor:
    """``E · Σ_e (counts_e / rows) · (probabilities_e / rows)``: the Switch Transformer's loss of pooled statistics
    (Fedus et al. 2021, Eq. 4-6; transformers' ``load_balancing_loss_func``)."""
    return torch.sum((counts / rows) * (probabilities / rows)) * num_experts


def per_layer_balancing(gate_logits: Sequence[Tensor], num_experts: int, top_k: int,
                        attention_mask: Optional[Tensor], tokens: RouterTokens) -> Tensor:
    """``Σ_l`` :func:`pooled_balancing` of layer l's statistics over every rank's tokens: the global value; the
    gradient on this rank's logits is its share."""
    counts, probabilities, rows = _layer_statistics(gate_logits, num_experts, top_k, attention_mask, tokens)
    counts, probabilities, rows = _reduced(counts, probabilities, rows, tokens)
    return torch.sum((counts / rows[:, None]) * (probabilities / rows[:, None])) * num_experts


def _layer_statistics(gate_logits: Sequence[Tensor], num_experts: int, top_k: int, attention_mask: Optional[Tensor],
                      tokens: RouterTokens) -> tuple[Tensor, Tensor, Tensor]:
    """Each layer's counts ``[L, E]``, probability sums ``[L, E]`` and rows ``[L]`` of this rank's tokens."""
    device = gate_logits[0].device
    weights = _row_weights(attention_mask, tokens, device)
    per: dict[str, list[Tensor]] = {"counts": [], "probabilities": [], "rows": []}  # each layer's: [E], [E], []
    for logits in gate_logits:
        routing = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        each = torch.ones(chosen.numel(), dtype=torch.float32, device=device) if weights is None \
            else weights.repeat_interleave(top_k)
        per["counts"].append(torch.zeros(num_experts, dtype=torch.float32, device=device).index_add(
            0, chosen.reshape(-1), each))
        per["probabilities"].append((routing.float() if weights is None else routing.float() * weights[:, None]).sum(0))
        per["rows"].append(torch.full((), float(routing.shape[0]), device=device) if weights is None else weights.sum())
    return tuple(torch.stack(per[key]) for key in ("counts", "probabilities", "rows"))  # type: ignore[return-value]


def _reduced(counts: Tensor, probabilities: Tensor, rows: Tensor, tokens: RouterTokens
             ) -> tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():  # the counts and the rows in one reduction per group
        totals = torch.cat([counts, rows.unsqueeze(-1)], dim=-1)
        for group in tokens.groups:
            totals = group.all_reduce(totals)
        counts, rows = totals[..., :-1], totals[..., -1]
    return counts, _SumOverRanks.apply(probabilities, tokens.groups), rows


def parallel_router_z_loss(gate_logits: tuple[Tensor, ...], attention_mask: Optional[Tensor],
                           tokens: RouterTokens) -> Tensor:
    """The router z-loss over every rank's tokens, summed over the layers: ``Σ_l mean_i (log Σ_e exp x_ie)²`` (Zoph
    et al., *ST-MoE*, 2022, Eq. 5; Megatron-Core's ``z_loss_func`` per layer), the mean over the step's tokens (padding
    left out where ``attention_mask`` says), in float32; value and gradient as :func:`parallel_load_balancing_loss`'s,
    the earlier pipeline stages' layers included on the last one.
    """
    loss = router_z(gate_logits, attention_mask, tokens)
    upstream = tokens.stages.upstream if tokens.stages is not None else None
    if upstream is not None:
        loss = loss + upstream.z
        tokens.stages.consumed(upstream)
    return as_replica_loss(loss, tokens)


def router_z(gate_logits: Sequence[Tensor], attention_mask: Optional[Tensor], tokens: RouterTokens) -> Tensor:
    """``Σ_l mean_i (log Σ_e exp x_ie)²`` of ``gate_logits`` over every rank's tokens: the global value; the gradient
    on this rank's logits is its share."""
    device = gate_logits[0].device
    weights = _row_weights(attention_mask, tokens, device)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in gate_logits:
        z = torch.logsumexp(logits.float(), dim=-1).square()
        squares = squares + (z.sum() if weights is None else (z * weights).sum())
        rows = rows + (float(z.shape[0]) if weights is None else weights.sum())
    with torch.no_grad():
        for group in tokens.groups:
            rows = group.all_reduce(rows)
    squares = _SumOverRanks.apply(squares, tokens.groups)
    return squares / rows * len(gate_logits)  # rows counted once per layer


def _row_weights(attention_mask: Optional[Tensor], tokens: RouterTokens, device: torch.device) -> Optional[Tensor]:
    return None if attention_mask is None else tokens.rows_of(attention_mask).to(device, torch.float32)


def as_replica_loss(loss: Tensor, tokens: RouterTokens) -> Tensor:
    """A router loss over every rank's tokens (``loss``: the global value, its gradient this rank's share) as this
    replica's term of the loss. The value: 1/c of the loss on each cp rank, whose losses are summed. The gradient: d
    times this rank's share (times c again by the sum over cp's backward), undone by the division by d·c of every
    gradient."""
    return loss.detach() / tokens.context_parallel + tokens.data_parallel * (loss - loss.detach())


def load_balancing_loss(gate_logits: tuple[Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: Optional[Tensor] = None, per_layer: bool = False) -> Tensor:
    """The load-balancing loss of ``gate_logits`` (one ``[n, E]`` tensor per layer): over every rank's tokens when a
    parallel block produced them (:data:`MARK`), else over these rows alone (one process, rows in ``[b, s]`` order).
    Used by the reference GPT's mixture of experts, on one device and rewritten alike."""
    return parallel_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask, _tokens_of(gate_logits),
                                        per_layer)


def router_z_loss(gate_logits: tuple[Tensor, ...], attention_mask: Optional[Tensor] = None) -> Tensor:
    """The router z-loss of ``gate_logits`` (:func:`parallel_router_z_loss`), over every rank's tokens when a parallel
    block produced them, else over these rows alone."""
    return parallel_router_z_loss(gate_logits, attention_mask, _tokens_of(gate_logits))


def _tokens_of(gate_logits: tuple[Tensor, ...]) -> RouterTokens:
    return getattr(gate_logits[0], MARK, None) or RouterTokens((), 1, 1, _BatchRows())


@dataclass(frozen=True)
class _BatchRows:
    """One process's rows: ``[b, s]`` flattened, as the model's own layers order them."""

    def __call__(self, mask: Tensor) -> Tensor:
        return mask.reshape(-1)
