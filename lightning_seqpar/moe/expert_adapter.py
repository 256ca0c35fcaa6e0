"""A LoRA adapter on one packed projection of this rank's experts (PEFT's ``ParamWrapper`` with
``target_parameters``), computed low-rank over the rows grouped by expert.

PEFT keeps one adapter per packed weight of E experts as two matrices: ``A`` ``[r·E, in]`` (expert-major: expert i's
rows ``i·r … i·r + r``) and ``B`` ``[out, r·E]`` (expert-minor: expert i's columns ``i, i + E, …``), and adapts each
expert's weight by ``(α/r) · B_i A_i``, merged into the weight on every call (``get_delta_weight``). ``in`` and ``out``
are the product's, whichever way the weight is stored (``[E, out, in]``, or ``[E, in, out]`` for gpt-oss).

Here the rank holds the ``A`` rows and ``B`` columns of its ``E/e`` experts in the same layouts (``[r·E/e, in]`` and
``[out, r·E/e]``), so the whole-model shapes stay PEFT's, and adds ``(α/r) · (x A_iᵀ) B_iᵀ`` to each expert's product:
two products of width r per expert instead of a second ``[E/e, out, in]`` weight, the same function to rounding. Both
go through :func:`~lightning_seqpar.moe.expert_product.expert_product`, so a split backward leaves their weight
gradients to W (handed to the adapter's own parameters), and the grouped GEMM computes them where the base takes it.
``B``'s expert-major copy is made again in backward, not kept: a micro-batch in flight keeps the products' inputs only
(the rows ``[R, in]`` and the ``[R, r]`` between the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_seqpar.moe.expert_product import expert_product
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

PROJECTIONS = ("gate_up_proj", "down_proj")
"""The packed expert weights an adapter may target."""


@dataclass(frozen=True)
class ExpertAdapter:
    """One projection's adapter on this rank's experts.

    Attributes:
        parameter_name: the packed weight it adapts (:data:`PROJECTIONS`).
        a: ``[r·E/e, in]`` (``in/etp`` for ``down_proj`` under expert tensor parallelism).
        b: ``[out, r·E/e]`` (``out/etp`` for ``gate_up_proj`` under expert tensor parallelism).
        rank: r.
        scaling: α/r (α/√r with rsLoRA).
    """

    parameter_name: str
    a: Tensor
    b: Tensor
    rank: int
    scaling: float

    def product(self, rows: Tensor, store: Optional[WeightGradientStore], *, offsets: Optional[Tensor] = None,
                sizes: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
        """``rows`` ``[R, in]`` grouped by local expert → ``(α/r) · (rows A_iᵀ) B_iᵀ`` ``[R, out]``, computed as the
        base's product is (``offsets``: the grouped GEMM; ``sizes``: the loop), weight gradients to W under
        ``store``."""
        how = dict(offsets=offsets, sizes=sizes, dtype=dtype)
        low = expert_product(rows, self.a, False, store, packed=_ExpertMajor(self.rank), **how)  # [R, r]
        return expert_product(low, self.b, False, store, packed=_ExpertMinor(self.rank), **how) * self.scaling


@dataclass(frozen=True)
class _ExpertMajor:
    """``A`` ``[r·E, in]`` as ``[E, r, in]``: a view."""

    rank: int

    def experts(self, parameter: Tensor) -> Tensor:
        return parameter.view(-1, self.rank, parameter.shape[1])

    def gradient(self, experts: Tensor) -> Tensor:
        return experts.reshape(-1, experts.shape[2])


@dataclass(frozen=True)
class _ExpertMinor:
    """``B`` ``[out, r·E]`` (expert i's columns ``i, i + E, …``) as ``[E, out, r]``: a contiguous copy, which the
    grouped GEMM needs (a permuted view has no unit stride) and which the product makes again in backward rather than
    keep."""

    rank: int

    def experts(self, parameter: Tensor) -> Tensor:
        return parameter.view(parameter.shape[0], self.rank, -1).permute(2, 0, 1).contiguous()

    def gradient(self, experts: Tensor) -> Tensor:
        return experts.permute(1, 2, 0).reshape(experts.shape[1], -1)


def adapted(out: Tensor, rows: Tensor, adapter: Optional[ExpertAdapter], store: Optional[WeightGradientStore],
            **how: object) -> Tensor:
    """``out`` plus ``adapter``'s product of ``rows`` (``how``: :meth:`ExpertAdapter.product`'s keywords), or
    ``out`` where the projection has none."""
    return out if adapter is None else out + adapter.product(rows, store, **how)
