"""GRPO's loss and advantages against TRL 1.16's own code, and how a step's loss splits.

The oracle is ``trl.GRPOTrainer._compute_loss`` itself, run on a stand-in trainer holding only what it reads (the
settings, one process, the accumulation steps) and a model stand-in returning the given per-token log-probabilities.
For every loss type, with and without the KL term and DAPO's clip-higher, TRL's losses of a step's micro-batches
(accumulation 4, every micro-batch of the same number of completions) sum to the sum of our shares, and their
gradients agree; our ``grpo``, ``dr_grpo`` and ``dapo`` give the same gradient whatever the split (micro-batches of
uneven sizes included), ``bnpo`` is the mean of its micro-batches' token means."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_seqpar.models.grpo import LOSS_TYPES, GRPOLoss, StepCounts, clip_ratios, group_advantages

B, T, G = 8, 6, 4  # completions per step, completion length, completions per prompt


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # ratios well past the clip
    ref = logps.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    lengths = torch.tensor([6, 3, 5, 1, 6, 2, 4, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, advantages


def _trl_loss(loss: GRPOLoss, logps, old, ref, mask, advantages, accumulation: int, tokens_in_step: float):
    """TRL's ``_compute_loss`` of one micro-batch (``logps`` etc. its rows)."""
    from trl import GRPOTrainer

    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation)
    trainer = SimpleNamespace(
        args=args, loss_type=loss.loss_type, epsilon_low=loss.epsilon_low, epsilon_high=loss.high, beta=loss.beta,
        max_completion_length=loss.max_completion_length, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    inputs = dict(prompt_ids=torch.zeros(len(logps), 1, dtype=torch.long), prompt_mask=torch.ones(len(logps), 1),
                  completion_ids=torch.zeros(len(logps), T, dtype=torch.long), completion_mask=mask,
                  advantages=advantages, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=torch.tensor(tokens_in_step))
    return GRPOTrainer._compute_loss(trainer, None, inputs)


SETTINGS = [dict(), dict(beta=0.04), dict(epsilon_high=0.28), dict(beta=0.1, epsilon_low=0.1, epsilon_high=0.3)]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_is_trl_s_over_an_accumulated_step(loss_type, settings):
    loss = GRPOLoss(loss_type, max_completion_length=T, **settings)
    logps, old, ref, mask, advantages = _batch()
    counts = StepCounts(completions=B, tokens=int(mask.sum()), shares=4)
    ours = sum(loss.share(loss.per_token(logps[i:i + 2], old[i:i + 2], advantages[i:i + 2], ref[i:i + 2]),
                          mask[i:i + 2], counts) for i in range(0, B, 2))
    ours_grad, = torch.autograd.grad(ours, logps)
    theirs = sum(_trl_loss(loss, logps[i:i + 2], old[i:i + 2], ref[i:i + 2], mask[i:i + 2], advantages[i:i + 2], 4,
                           float(mask.sum())) for i in range(0, B, 2))
    theirs_grad, = torch.autograd.grad(theirs, logps)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)
    assert ours_grad.abs().sum() > 0  # (the clip does not hide every token)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_the_step_s_gradient_does_not_depend_on_how_its_completions_are_split(loss_type):
    """One micro-batch of 8, or pieces of 3, 1, 4 (uneven: where TRL's per-micro-batch means would differ), in
    float32: the same gradient within 1e-6."""
    loss = GRPOLoss(loss_type, max_completion_length=T, beta=0.04)
    logps, old, ref, mask, advantages = (x.float() if x.is_floating_point() else x for x in _batch(1))
    logps = logps.detach().requires_grad_()
    counts = StepCounts(completions=B, tokens=int(mask.sum()))

    def step(pieces):
        total, start = 0.0, 0
        for size in pieces:
            rows = slice(start, start + size)
            total = total + loss.share(loss.per_token(logps[rows], old[rows], advantages[rows], ref[rows]),
                                       mask[rows], counts)
            start += size
        return torch.autograd.grad(total, logps)[0]

    whole = step([B])
    assert (step([3, 1, 4]) - whole).abs().max() <= 1e-6
    assert (step([1] * B) - whole).abs().max() <= 1e-6


def test_bnpo_is_the_mean_of_its_micro_batches_token_means():
    loss = GRPOLoss("bnpo", max_completion_length=T)
    logps, old, ref, mask, advantages = _batch(2)
    per_token = loss.per_token(logps, old, advantages)
    halves = [loss.share(per_token[rows], mask[rows], StepCounts(B, int(mask.sum()), shares=2))
              for rows in (slice(0, 4), slice(4, 8))]
    means = [(per_token[rows] * mask[rows]).sum() / mask[rows].sum() for rows in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(sum(halves), (means[0] + means[1]) / 2)
    whole = (per_token * mask).sum() / mask.sum()
    assert not torch.allclose(sum(halves), whole)  # token counts differ between the halves: split-dependent


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_are_trl_s(scale):
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    advantages, std = group_advantages(rewards, G, scale)
    groups = rewards.view(-1, G)
    mean = groups.mean(-1).repeat_interleave(G)
    trl_std = nanstd(rewards).expand_as(rewards) if scale == "batch" else \
        nanstd(groups, dim=1).repeat_interleave(G)
    want = rewards - mean if scale == "none" else (rewards - mean) / (trl_std + 1e-4)
    # (TRL's nanstd takes Bessel's n/(n−1) in float32, whatever the rewards' dtype: a relative 1.5e-8)
    torch.testing.assert_close(advantages, want, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(std, trl_std, rtol=1e-7, atol=1e-12)
    if scale != "batch":
        assert bool((std[4:8] == 0).all()) and bool((advantages[4:8] == 0).all())  # a group of equal rewards


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="group_size=1"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="group_size=3 for 4 rewards"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="scale_rewards='mean'"):
        group_advantages(torch.zeros(4), 2, "mean")
    with pytest.raises(ValueError, match="grpo.loss_type='ppo'"):
        GRPOLoss("ppo")
    with pytest.raises(ValueError, match="beta=-1"):
        GRPOLoss(beta=-1)
    logps, old, _, _, advantages = _batch()
    with pytest.raises(ValueError, match="beta=0.1 needs the reference"):
        GRPOLoss(beta=0.1).per_token(logps, old, advantages)


def test_the_clip_ratios_count_the_tokens_trl_counts():
    loss = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28)
    logps, old, _, mask, advantages = _batch(3)
    ratios = clip_ratios(logps.detach(), old, advantages, mask, loss)
    ratio = torch.exp(logps.detach() - old)
    low = ((ratio < 0.8) & (advantages[:, None] < 0)).double()
    high = ((ratio > 1.28) & (advantages[:, None] > 0)).double()
    assert ratios["low_mean"][0] == (low * mask).sum() and ratios["high_mean"][0] == (high * mask).sum()
    assert ratios["region_mean"][0] == ((low + high) * mask).sum() > 0 and ratios["region_mean"][1] == mask.sum()
