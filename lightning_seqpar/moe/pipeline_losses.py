"""Router losses of a mixture of experts split into pipeline stages: the same value and gradient as one process.

transformers' load-balancing loss pools the router statistics of every layer (``E · Σ_e T_e · P_e`` with ``T`` and
``P`` summed over all layers' tokens), and each pipeline stage holds only its own layers. It is bilinear in the
pooled sums: ``T`` (the (token, top-k) counts and the rows) carries no gradient, and the gradient on layer l's
probability sums is ``E · T / N²``, the same for every layer. So each stage's share of the loss is
``S_k = E · Σ_e (T_e / N) · (P_e^k / N)`` with ``T`` and ``N`` over *all* layers, and ``Σ_k S_k`` is the loss.

A micro-batch's statistics travel with it (:class:`RouterStatistics`, a float32 vector of ``2E + 4``):

* forward, each stage adds its layers' counts, rows, probability sums (values only) and its per-layer terms (the
  Switch loss of each layer, the z-loss: sums over layers, local to a stage) to what it received and sends the sum
  on with the activation; the last stage's loss reads it (:attr:`StageRouterLosses.upstream`) and so has the one-process
  value, its gradient flowing to its own layers only;
* backward, the last stage sends the totals its loss used back with the activation gradient, and each earlier
  stage back-propagates its ``S_k`` (and its per-layer terms) with the micro-batch's scale, beside the gradient it
  received.

Megatron-Core attaches a per-layer auxiliary loss to the activation's backward (``MoEAuxLossAutoScaler``) and has no
pooled loss under pipeline parallelism; the pooled one needs the totals, hence the backward message.
The 2-D ``attention_mask`` (padding left out of the statistics) is read on every stage from the model's own call
(a forward pre-hook on the module that holds the config); under context parallelism a mask stays refused
(:class:`~lightning_seqpar.moe.balancing.UnmaskableRows`).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.moe.balancing import (
    MARK, RouterTokens, as_replica_loss, per_layer_balancing, pooled_balancing, router_statistics, router_z,
)


@dataclass(frozen=True)
class RouterLossTerms:
    """The router losses a model adds to its loss, and their coefficients.

    Attributes:
        num_experts: E.
        top_k: k, the experts per token.
        pooled: the coefficient of the load-balancing loss pooled over the layers (transformers'
            ``router_aux_loss_coef``; the reference GPT's ``aux_loss_coef`` with ``aux_loss_type="pooled"``), else 0.
        per_layer: the coefficient of the sum of each layer's load-balancing loss, else 0.
        z: the coefficient of the router z-loss, else 0.
    """

    num_experts: int
    top_k: int
    pooled: float = 0.0
    per_layer: float = 0.0
    z: float = 0.0

    @staticmethod
    def of(config: Any) -> Optional["RouterLossTerms"]:
        """The terms of a model ``config`` that records its router logits (``output_router_logits``), else ``None``:
        the reference GPT's ``GPTConfig`` (its ``aux_loss_type``, ``z_loss_coef``) or a transformers config
        (``router_aux_loss_coef``; ``num_experts`` or ``num_local_experts``; ``num_experts_per_tok``)."""
        if getattr(config, "output_router_logits", False) is not True:
            return None
        if hasattr(config, "aux_loss_type"):  # the reference GPT
            pooled = config.aux_loss_coef if config.aux_loss_type == "pooled" else 0.0
            per_layer = config.aux_loss_coef if config.aux_loss_type == "per_layer" else 0.0
            return RouterLossTerms(config.n_experts, config.experts_per_token, pooled, per_layer, config.z_loss_coef)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return RouterLossTerms(int(experts), int(config.num_experts_per_tok), float(config.router_aux_loss_coef))


@dataclass(frozen=True)
class RouterStatistics:
    """One micro-batch's router statistics over some layers and every rank's tokens, float32.

    Attributes:
        counts: ``[E]`` (token, top-k) choices per expert.
        rows: ``[]`` tokens (weighted by the attention mask).
        probabilities: ``[E]`` router probabilities summed per expert.
        per_layer: ``[]`` the sum of each layer's load-balancing loss.
        z: ``[]`` the sum of each layer's router z-loss.
        used: ``[]`` 1 where the last stage's loss read these statistics (its model adds the router losses).
    """

    counts: Tensor
    rows: Tensor
    probabilities: Tensor
    per_layer: Tensor
    z: Tensor
    used: Tensor

    @staticmethod
    def zeros(num_experts: int, device: torch.device) -> "RouterStatistics":
        """No layer's statistics: what the first stage starts from."""
        return RouterStatistics.from_vector(torch.zeros(2 * num_experts + 4, device=device), num_experts)

    @staticmethod
    def from_vector(vector: Tensor, num_experts: int) -> "RouterStatistics":
        """Read the ``[2E + 4]`` message :meth:`vector` wrote."""
        e = num_experts
        return RouterStatistics(vector[:e], vector[e], vector[e + 1:2 * e + 1], vector[2 * e + 1], vector[2 * e + 2],
                                vector[2 * e + 3])

    def vector(self) -> Tensor:
        """The ``[2E + 4]`` float32 message: counts, rows, probabilities, per-layer, z, used."""
        scalars = torch.stack([self.per_layer, self.z, self.used]).float()
        return torch.cat([self.counts.float(), self.rows.float().reshape(1), self.probabilities.float(), scalars])

    def joined(self, counts: Tensor, probabilities: Tensor, rows: Tensor) -> "RouterStatistics":
        """These statistics with another stage's pooled ones added (no gradient kept)."""
        return dataclasses.replace(self, counts=self.counts + counts, rows=self.rows + rows,
                                   probabilities=self.probabilities + probabilities.detach())

    def plus(self, other: "RouterStatistics") -> "RouterStatistics":
        """The element-wise sum (``used`` of ``self``)."""
        return RouterStatistics(self.counts + other.counts, self.rows + other.rows,
                                self.probabilities + other.probabilities, self.per_layer + other.per_layer,
                                self.z + other.z, self.used)


@dataclass
class _Kept:
    """A non-last stage's differentiable terms of one micro-batch, until its backward."""

    probabilities: Optional[Tensor]
    per_layer: Optional[Tensor]
    z: Optional[Tensor]


class StageRouterLosses:
    """Carries one rank's router statistics between pipeline stages (see the module docstring): the pipeline's
    :class:`~lightning_seqpar.pipeline_parallel.payload.StagePayload` of a model adding router losses.

    Args:
        terms: the model's router losses.
        moe_parts: this rank's mixture-of-experts parts by virtual stage (``MoEPart``, in layer order).
        last_stage: the index of the last virtual stage.

    Attributes:
        parts: one vector beside each activation and gradient (the pipeline's
            :class:`~lightning_seqpar.pipeline_parallel.payload.StagePayload`).
        upstream: the statistics received for the forward running on the last stage (read by its loss), else
            ``None``.
        collecting: whether a stage's forward is running (its mixture parts keep their router logits for it).
        attention_mask: the 2-D mask of the model's last call (:meth:`capture`), or ``None``.
    """

    def __init__(self, terms: RouterLossTerms, moe_parts: dict[int, list[nn.Module]], last_stage: int) -> None:
        self.terms, self.moe_parts, self.last_stage = terms, moe_parts, last_stage
        self.upstream: Optional[RouterStatistics] = None
        self.attention_mask: Optional[Tensor] = None
        self.parts = 1
        self._kept: dict[tuple[int, int], _Kept] = {}
        self._totals: dict[int, Tensor] = {}
        self._running: Optional[int] = None
        self.collecting = False  # while a stage's forward runs: the mixture parts keep their logits
        self._mask_position: Optional[int] = None  # attention_mask's place among the forward's arguments (-1: none)

    @property
    def width(self) -> int:
        """Elements of the float32 vector sent with each activation and gradient: ``2E + 4``."""
        return 2 * self.terms.num_experts + 4

    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the module holding the config: keep its call's ``attention_mask`` (or ``None``)."""
        mask = kwargs.get("attention_mask")
        if mask is None and args:  # given by position: where the forward's signature puts it
            if self._mask_position is None:
                names = list(inspect.signature(module.forward).parameters)
                self._mask_position = names.index("attention_mask") if "attention_mask" in names else -1
            if 0 <= self._mask_position < len(args):
                mask = args[self._mask_position]
        self.attention_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None

    def forward_begins(self, stage: int, microbatch: int, received: tuple[Tensor, ...], device: torch.device) -> None:
        """Before virtual stage ``stage``'s forward of ``microbatch``: what the earlier stages sent (``()`` on the
        first stage). Forgets every part's logits, so that only this forward's are read."""
        self._release()
        self.collecting = True
        e = self.terms.num_experts
        self.upstream = RouterStatistics.from_vector(received[0], e) if received else RouterStatistics.zeros(e, device)
        self._running = microbatch
        if stage == self.last_stage:
            self._totals.pop(microbatch, None)

    def consumed(self, totals: RouterStatistics, pooled: bool = False) -> None:
        """Called by the last stage's loss: the statistics it used, sent back to the earlier stages. ``pooled``: these
        totals hold the last stage's own counts too (the pooled loss's); the per-layer and z-losses read only what
        was received, and do not replace them."""
        assert self._running is not None
        if pooled or self._running not in self._totals:
            self._totals[self._running] = dataclasses.replace(totals, used=torch.ones_like(totals.used)).vector()

    def forward_sends(self, stage: int, microbatch: int, training: bool) -> tuple[Tensor]:
        """After a non-last stage's forward: its layers' statistics added to what it received, to send on ``[2E+4]``;
        in training, its differentiable terms kept until :meth:`backward_share`."""
        assert self.upstream is not None
        logits = [p.last_logits for p in self.moe_parts.get(stage, []) if p.last_logits is not None]
        own = RouterStatistics.zeros(self.terms.num_experts, self.upstream.counts.device)
        kept = _Kept(None, None, None)
        if logits:  # only the terms the model adds: each is a softmax over the logits and a reduction per group
            tokens, mask, e, k = self._tokens(logits), self.attention_mask, self.terms.num_experts, self.terms.top_k
            counts, probabilities, rows = router_statistics(logits, e, k, mask, tokens) if self.terms.pooled else \
                (own.counts, own.probabilities, own.rows)
            per_layer = per_layer_balancing(logits, e, k, mask, tokens) if self.terms.per_layer else own.per_layer
            z = router_z(logits, mask, tokens) if self.terms.z else own.z
            own = RouterStatistics(counts, rows, probabilities.detach(), per_layer.detach(), z.detach(), own.used)
            if training:
                kept = _Kept(probabilities if self.terms.pooled else None,
                             per_layer if self.terms.per_layer else None, z if self.terms.z else None)
        if training:
            self._kept[(stage, microbatch)] = kept
        out = self.upstream.plus(own).vector()
        self.forward_ends()
        return (out,)

    def forward_ends(self) -> None:
        """After a forward: the logits and what was received are not read again (nor kept by a forward recomputed
        in backward)."""
        self.upstream = None
        self.collecting = False
        self._release()

    def _release(self) -> None:
        for part in (p for parts in self.moe_parts.values() for p in parts):
            part.last_logits = None
            if hasattr(part.router, "last_logits"):  # the reference GPT's router keeps them for its loss
                part.router.last_logits = None

    def backward_sends(self, microbatch: int, device: torch.device) -> tuple[Tensor]:
        """On the last stage, after its backward of ``microbatch``: the statistics its loss used ``[2E+4]`` (zeros,
        ``used = 0``, where its loss did not read them)."""
        vector = self._totals.pop(microbatch, None)
        return (vector if vector is not None else torch.zeros(self.width, device=device),)

    def backward_share(self, stage: int, microbatch: int, received: tuple[Tensor, ...]) -> Optional[Tensor]:
        """A non-last stage's share of the router losses of ``microbatch``, given the totals the last stage's loss
        used (``received[0]``): a scalar whose gradient is this stage's layers' one-process gradient (times d·c, as the
        loss's is), ``None`` where nothing flows."""
        kept = self._kept.pop((stage, microbatch))
        total = RouterStatistics.from_vector(received[0], self.terms.num_experts)
        shares: list[Tensor] = []
        if kept.probabilities is not None:
            shares.append(self.terms.pooled * pooled_balancing(total.counts, kept.probabilities, total.rows,
                                                              self.terms.num_experts))
        if kept.per_layer is not None:
            shares.append(self.terms.per_layer * kept.per_layer)
        if kept.z is not None:
            shares.append(self.terms.z * kept.z)
        if not shares:
            return None
        tokens = self._tokens(None)
        # The last stage's loss passes the sum over context-parallel ranks, whose backward multiplies by c.
        return total.used * tokens.context_parallel * as_replica_loss(torch.stack(shares).sum(), tokens)

    def _tokens(self, logits: Optional[list[Tensor]]) -> RouterTokens:
        part = next(p for parts in self.moe_parts.values() for p in parts)
        return part.tokens if logits is None else getattr(logits[0], MARK, part.tokens)

    def forget(self) -> None:
        """Drop what a step left (a step that raised)."""
        self._kept.clear()
        self._totals.clear()
        self.upstream = None
        self._running = None
        self.collecting = False
