"""Group relative policy optimization (Shao et al., *DeepSeekMath*, 2024): the advantages of a group of completions
of one prompt, and the clipped surrogate loss with TRL's four normalisations, written so that a step's gradient does
not depend on how its batch is split.

For completion i of a group of G completions of one prompt, with reward r_i (the weighted sum of the reward
functions), and each of its tokens t with log-probability ``logp`` under the policy, ``old`` under the policy that
sampled it and ``ref`` under the reference:

    A_i = (r_i − mean(r_group)) / (std(r_group) + 1e-4)           scale "group" (std over the whole batch: "batch";
                                                                  no division: "none"); std with Bessel's correction
    ρ = exp(logp − old)
    ℓ_t = −min(ρ·A_i, clip(ρ, 1 − ε_low, 1 + ε_high)·A_i) + β·(exp(ref − logp) − (ref − logp) − 1)

(TRL 1.16's ``GRPOTrainer``: ``multi_objective_aggregation="sum_then_normalize"``, token-level importance sampling,
the k3 estimator of the KL term). The loss of a step is a weighted sum of the ℓ_t of its completions' tokens (mask
``m``: 1 on a completion token) over a normaliser:

    grpo     Σ_i (Σ_t m·ℓ_t / max(Σ_t m, 1)) / N_seq       the mean over completions of each one's token mean
    dr_grpo  Σ_i Σ_t m·ℓ_t / (N_seq · L_max)               Dr. GRPO: the max_completion_length as a constant
    dapo     Σ_i Σ_t m·ℓ_t / N_tok                         DAPO: the token mean over the step's completions
    bnpo     mean over micro-batches of Σ m·ℓ / Σ m        the token mean of each micro-batch, averaged

``N_seq`` and ``N_tok`` count the completions and completion tokens of the whole optimizer step: every accumulated
micro-batch of every data-parallel replica. Each micro-batch contributes its share (:meth:`GRPOLoss.share`), and
the shares of a step sum to its loss, so ``grpo``, ``dr_grpo`` and ``dapo`` give the same gradient however the step's
completions are split into micro-batches and replicas (and at any tp, pp, cp: they do not change the completions).
TRL divides each micro-batch's loss by its own count for ``grpo``, ``dr_grpo`` and ``bnpo``, and the framework
averages them: the same where every micro-batch holds as many completions (the usual case, and the one its tests
compare), and split-dependent where not. ``bnpo`` is TRL's definition: the token mean of each micro-batch, so it is
invariant to tp, pp and cp, not to how completions are grouped into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
_STD_EPSILON = 1e-4  # TRL's: added to the standard deviation before dividing


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group") -> tuple[Tensor, Tensor]:
    """The advantages ``[N]`` of ``rewards`` ``[N]`` (N = groups · G, each group's G completions adjacent; NaN: a
    completion no reward function scored, left out of its group's statistics and given no advantage) and the
    standard deviation each was scaled by (``[N]``; zero where a group's rewards are all equal).

    Raises:
        ValueError: ``group_size`` below 2 or not dividing N; ``scale`` not one of :data:`SCALES`.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size} for {rewards.numel()} rewards: GRPO compares G >= 2 completions of "
                         f"each prompt (grpo.num_generations), and the rewards come G per prompt.")
    if scale not in SCALES:
        raise ValueError(f"scale_rewards={scale!r}: one of {SCALES}.")
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.nanmean(-1, keepdim=True)).reshape(-1)
    if scale == "batch":
        std = _nanstd(rewards, None).expand_as(rewards)
    else:  # "group", and "none" (which reports the group's std but does not divide by it)
        std = _nanstd(groups, -1).expand_as(groups).reshape(-1)
    advantages = centred if scale == "none" else centred / (std + _STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), std  # an unscorable completion (NaN reward): no advantage (TRL)


def _nanstd(values: Tensor, dim: Optional[int]) -> Tensor:
    """The standard deviation over ``dim`` (all: ``None``) of the values that are not NaN, with Bessel's correction
    (NaN where fewer than two are), kept as a dimension of size 1 (TRL's ``nanstd``)."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    mean = values.nanmean(dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True)
    variance = ((values - mean) ** 2).nansum(dim=dims, keepdim=True) / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


@dataclass(frozen=True)
class StepCounts:
    """What a step's normaliser counts, over all its micro-batches on every data-parallel replica.

    Attributes:
        completions: N_seq (an int, or a tensor: no host read).
        tokens: N_tok, the completion tokens (the mask's ones).
        shares: micro-batches times data-parallel replicas (``bnpo`` averages their token means).
        batch_tokens: ``bnpo``'s count: the completion tokens of the micro-batch whose token mean it takes (the batch
            a replica rolled out, which a pipeline splits further); ``None``: the rows given to :meth:`GRPOLoss.share`.
    """

    completions: Union[int, Tensor]
    tokens: Union[int, Tensor]
    shares: int = 1
    batch_tokens: Union[int, Tensor, None] = None


@dataclass(frozen=True)
class GRPOLoss:
    """The clipped surrogate and its normalisation (see the module docstring).

    Attributes:
        loss_type: one of :data:`LOSS_TYPES`.
        epsilon_low, epsilon_high: the clip range ``[1 − ε_low, 1 + ε_high]`` (DAPO's clip-higher: ε_high > ε_low;
            ``None``: ε_low).
        beta: the KL coefficient (0: no reference needed).
        max_completion_length: L_max, ``dr_grpo``'s constant.

    Raises:
        ValueError: an unknown ``loss_type``, a negative ε or β, ``max_completion_length`` below 1.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    max_completion_length: int = 256

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type={self.loss_type!r}: one of {LOSS_TYPES}.")
        high = self.epsilon_low if self.epsilon_high is None else self.epsilon_high
        if self.epsilon_low < 0 or high < 0 or self.beta < 0 or self.max_completion_length < 1:
            raise ValueError(f"grpo: epsilon={self.epsilon_low}, epsilon_high={self.epsilon_high} and beta="
                             f"{self.beta} must be >= 0, max_completion_length={self.max_completion_length} >= 1.")

    @property
    def high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def per_token(self, logps: Tensor, old_logps: Tensor, advantages: Tensor,
                  ref_logps: Optional[Tensor] = None) -> Tensor:
        """ℓ_t ``[B, T]`` of each completion token: ``logps``, ``old_logps``, ``ref_logps`` ``[B, T]``; ``advantages``
        ``[B]``.

        Raises:
            ValueError: ``beta > 0`` without ``ref_logps``.
        """
        ratio = torch.exp(logps - old_logps)
        advantage = advantages[:, None]
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.high)
        loss = -torch.min(ratio * advantage, clipped * advantage)
        if self.beta != 0.0:
            if ref_logps is None:
                raise ValueError(f"grpo.beta={self.beta} needs the reference's log-probabilities.")
            loss = loss + self.beta * kl_k3(logps, ref_logps)
        return loss

    def share(self, per_token: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
        """This micro-batch's part of the step's loss: the sum over the steps' micro-batches and replicas of these
        shares is the step's loss (a framework that averages micro-batch losses over accumulation and replicas is
        given ``share · counts.shares``).

        Args:
            per_token: ℓ_t ``[B, T]`` of this micro-batch's completions.
            mask: ``[B, T]``, 1 on a completion token.
            counts: the step's :class:`StepCounts`.
        """
        masked = per_token * mask
        if self.loss_type == "grpo":
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / _at_least_one(counts.completions)
        if self.loss_type == "dr_grpo":
            return masked.sum() / (_at_least_one(counts.completions) * self.max_completion_length)
        if self.loss_type == "dapo":
            return masked.sum() / _at_least_one(counts.tokens)
        tokens = mask.sum() if counts.batch_tokens is None else counts.batch_tokens
        return masked.sum() / _at_least_one(tokens) / counts.shares  # bnpo: its micro-batch's token mean


def _at_least_one(count: Union[int, Tensor]) -> Union[int, Tensor]:
    return count.clamp(min=1) if isinstance(count, Tensor) else max(count, 1)


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """The k3 estimator of KL(π ‖ π_ref) per token, ``exp(ref − logp) − (ref − logp) − 1`` (Schulman, *Approximating
    KL divergence*, 2020; TRL's)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clip_ratios(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, loss: GRPOLoss
                ) -> dict[str, Tensor]:
    """Sums over the completion tokens (``[2]``-shaped pairs of sum and count, to be reduced over ranks and divided):
    TRL's ``clip_ratio/low_mean``, ``high_mean`` and ``region_mean``: tokens whose ratio left the clip range on the
    side where the advantage makes the clip bind."""
    ratio = torch.exp(logps - old_logps)
    advantage = advantages[:, None]
    low = (ratio < 1 - loss.epsilon_low) & (advantage < 0)
    high = (ratio > 1 + loss.high) & (advantage > 0)
    count = mask.sum()
    return {name: torch.stack([(flags.to(mask.dtype) * mask).sum(), count])
            for name, flags in (("low_mean", low), ("high_mean", high), ("region_mean", low | high))}
