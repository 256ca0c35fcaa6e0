"""GRPO as a LightningModule's objective: the rollout before each training batch, the loss in its step.

A module holding a causal LM (``self.model``, its loss a :class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`) and
a :class:`GRPOObjective` calls::

    def on_train_batch_start(self, batch, batch_idx):
        self.grpo.roll_out(self, batch)           # every rank, before the step (and its pipeline schedule)

    def training_step(self, batch, batch_idx):
        return self.grpo.loss(self, batch)

A training batch holds one replica's prompts: ``input_ids`` and ``attention_mask`` ``[n, P]`` (left-padded) and
``prompt_index`` ``[n]`` (each prompt's index in the dataset: its completions' seeds and its reward columns).
:meth:`GRPOObjective.roll_out` replaces them by the step's completion rows ``[n·G, ...]``
(:mod:`~.grpo_rollout`: sampled in the training layout, each completion from its own seeded generator, so the samples
do not depend on the layout or the split), scores them (:mod:`~.grpo_rewards`, on the replica's first rank, then
broadcast over its tensor- and pipeline-parallel ranks), and adds each row's advantage and the step's counts
(:class:`~.grpo.StepCounts`: completions and completion tokens over every replica). :meth:`GRPOObjective.loss` runs
the training forward on the rows it is given (a pipeline micro-batch of them, under pp) and returns their share of the
step's loss times ``d·a·m`` (:func:`~lightning_seqpar.lightning.loss_average.loss_replicas`: what the framework
averages over), so the step's gradient is the one-process gradient of :mod:`~.grpo`'s loss whatever the layout.

One update per rollout (TRL's ``num_iterations=1``): the old policy is the policy, its log-probabilities the
forward's own, detached. ``dapo`` normalises by the step's completion tokens, known once the whole step is rolled out:
with gradient accumulation (``accumulate_grad_batches > 1``) it is refused (accumulate through pipeline
micro-batches instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_seqpar.lightning.loss_average import loss_replicas, pipeline_microbatches
from lightning_seqpar.models.grpo import GRPOLoss, StepCounts, clip_ratios, group_advantages, kl_k3
from lightning_seqpar.models.grpo_rewards import Rewards
from lightning_seqpar.models.grpo_rollout import Rollout, policy_logps, policy_logps_and_entropy, rollout



@dataclass(frozen=True)
class GRPOSettings:
    """TRL's names (``GRPOConfig``) for what they share.

    Attributes:
        num_generations: G, completions per prompt (>= 2).
        max_completion_length: new tokens at most per completion.
        temperature, top_p, top_k: how completions are sampled.
        loss_type, epsilon, epsilon_high, beta: :class:`~.grpo.GRPOLoss`'s (``epsilon``: ε_low).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (:func:`~.grpo.group_advantages`).
        reward, reward_weights: the reward functions (:class:`~.grpo_rewards.Rewards`) and their weights.
        seed: the rollouts' seed (with the global step and each prompt's index: its completions' generators).
    """

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    scale_rewards: str = "group"
    reward: Sequence[Union[str, Callable]] = ("contains",)
    reward_weights: Optional[Sequence[float]] = None
    seed: int = 0


@dataclass
class GRPOObjective:
    """The rollout and the loss of GRPO (see the module docstring).

    Args:
        settings: :class:`GRPOSettings`.
        decode: token ids → text (the completions the rewards read).
        prompts: each dataset prompt's text (or messages), by its index.
        columns: the dataset's other columns (``answer``, ...), one list each, by prompt index.
        eos_token_id, pad_token_id: where a completion ends, and what pads it.

    Raises:
        ValueError: from :class:`~.grpo.GRPOLoss`, :class:`~.grpo_rewards.Rewards` and
            :meth:`~.grpo_rewards.Rewards.check_columns`; at the first rollout, ``beta > 0`` on a model without LoRA
            adapters (its reference would be a second, frozen copy).
    """

    settings: GRPOSettings
    decode: Callable[[list[int]], str]
    prompts: Sequence[Any]
    columns: dict[str, Sequence[Any]]
    eos_token_id: Union[int, Sequence[int], None]
    pad_token_id: int = 0
    metrics: dict[str, Tensor] = field(default_factory=dict)
    loss_metrics: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.settings
        self.objective = GRPOLoss(s.loss_type, s.epsilon, s.epsilon_high, s.beta, s.max_completion_length)
        self.rewards = Rewards(list(s.reward), s.reward_weights)
        self.rewards.check_columns(list(self.columns))

    def roll_out(self, module: Any, batch: dict) -> None:
        """Replace the prompts of ``batch`` by their completion rows, scored, with advantages and the step's counts
        (in place; see the module docstring). Collective: every rank calls it, before the step.

        Raises:
            ValueError: ``dapo`` under gradient accumulation, naming the fix.
        """
        trainer, s = module.trainer, self.settings
        accumulation = trainer.accumulate_grad_batches
        if s.loss_type == "dapo" and accumulation > 1:
            raise ValueError(f"grpo.loss_type=dapo normalises by the step's completion tokens, known only once every "
                             f"micro-batch is rolled out; accumulate_grad_batches={accumulation} rolls them out one "
                             f"at a time. Split the step over pipeline micro-batches, or use loss_type=grpo/dr_grpo.")
        index = batch.pop("prompt_index")
        seeds = [hash((s.seed, trainer.global_step, int(i))) % 2**31 for i in index.tolist()]
        done = rollout(module, batch.pop("input_ids"), batch.pop("attention_mask"), s.num_generations,
                       s.max_completion_length, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seeds=seeds,
                       eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        prompts = [i for i in index.tolist() for _ in range(s.num_generations)]
        rewards = self._scored(module, done, prompts)
        total = self.rewards.total(rewards)
        advantages, std = group_advantages(total, s.num_generations, s.scale_rewards)
        counts = self._counts(module, done, accumulation)
        rows = len(prompts)
        if s.beta != 0.0:
            batch["ref_logps"] = self._reference(module, done)
        batch.update(prompt_ids=done.prompt_ids, prompt_mask=done.prompt_mask, completion_ids=done.completion_ids,
                     completion_mask=done.completion_mask, advantages=advantages.to(done.logps.dtype),
                     rollout_logps=done.logps, step_counts=counts.expand(rows, -1).contiguous())
        self._measure(module, rewards, total, std, done)

    def loss(self, module: Any, batch: dict) -> Tensor:
        """The rows' share of the step's loss, times what the framework averages over (see the module docstring); sets
        :attr:`loss_metrics`: ``clip_ratio/region_mean``, ``entropy`` and, with the KL term, ``kl`` (TRL's), and the
        rollout's log-probabilities against the training forward's (``logps/rollout_mismatch_mean``, ``_max``: the
        trainer/rollout mismatch)."""
        part = Rollout(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                       batch["completion_mask"], self.settings.num_generations)
        multiple = _row_multiple(module.trainer.strategy)
        logps, entropy = policy_logps_and_entropy(module.model, part, multiple, self.pad_token_id)
        mask = batch["completion_mask"].to(logps.dtype)
        advantages = batch["advantages"].to(logps.dtype)
        reference = batch["ref_logps"].to(logps.dtype) if "ref_logps" in batch else None
        per_token = self.objective.per_token(logps, logps.detach(), advantages, reference)
        tokens = mask.sum().clamp(min=1)
        clipped = clip_ratios(logps.detach(), logps.detach(), advantages, mask, self.objective)["region_mean"]
        mismatch = (logps.detach() - batch["rollout_logps"].to(logps.dtype)).abs() * mask
        self.loss_metrics = {"clip_ratio/region_mean": clipped[0] / tokens, "entropy": (entropy * mask).sum() / tokens,
                             "logps/rollout_mismatch_mean": mismatch.sum() / tokens,
                             "logps/rollout_mismatch_max": mismatch.max()}
        if reference is not None:  # TRL's kl: the k3 estimate's mean over the completion tokens
            self.loss_metrics["kl"] = (kl_k3(logps.detach(), reference) * mask).sum() / tokens
        counts = batch["step_counts"][0].to(logps.dtype)
        trainer = module.trainer
        shares = loss_replicas(trainer) // pipeline_microbatches(trainer)  # d·a: the batches bnpo averages over
        share = self.objective.share(per_token, mask, StepCounts(counts[0], counts[1], shares, counts[2]))
        return share * loss_replicas(trainer)

    def _reference(self, module: Any, done: Rollout) -> Tensor:
        """``[N, C]``: the reference's log-probability of each completion token, at rollout time: the model with its
        LoRA adapters off (no second copy), without gradients; under pipeline parallelism a forward through the
        stages in order (:class:`~lightning_seqpar.generation.staged_forward.StagedForward`), its values on the last
        stage's ranks (which compute the loss), zeros elsewhere.

        Raises:
            ValueError: a model without LoRA adapters, naming the fix.
        """
        from lightning_seqpar.generation.staged_forward import StagedForward
        from lightning_seqpar.transformer.lora import ParallelLoRA, adapters_disabled
        from lightning_seqpar.transformer.tuner_layers import is_peft_tuner_layer

        model = module.model
        if not any(isinstance(m, ParallelLoRA) or is_peft_tuner_layer(m) for m in model.modules()):
            raise ValueError(f"grpo.beta={self.settings.beta}: the KL term's reference is the base with LoRA's "
                             f"adapters off, and this model has none (full fine-tuning would keep a second, frozen "
                             f"copy, which is not implemented). Train with peft=lora, or with beta=0 (TRL's default).")
        strategy = module.trainer.strategy
        multiple, pipeline = _row_multiple(strategy), getattr(strategy, "pipeline", None)
        training = model.training
        model.eval()  # (no adapter or attention dropout in the reference)
        try:
            with torch.no_grad(), adapters_disabled(model):
                forward = lambda: policy_logps(model, done, multiple, self.pad_token_id)  # noqa: E731
                if pipeline is None:
                    return forward()
                staged = StagedForward(pipeline)
                out = staged(forward, ("reference", *done.completion_ids.shape, done.prompt_ids.shape[1]))
        finally:
            model.train(training)
        return out if out is not None else torch.zeros(done.completion_ids.shape, dtype=done.logps.dtype,
                                                       device=done.logps.device)

    def _scored(self, module: Any, done: Rollout, prompts: list[int]) -> Tensor:
        """``[N, k]`` rewards, computed on the replica's first rank (tensor- and pipeline-parallel rank 0) and
        broadcast over the replica's other ranks."""
        mesh = getattr(module.trainer.strategy, "mesh", None)
        first = mesh is None or mesh.leads_replica
        rewards = torch.zeros(len(prompts), len(self.rewards.functions), dtype=torch.float64)
        if first:  # each completion's text without its end token (TRL decodes skipping special tokens)
            ends = set([self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id or ()))
            texts = [self.decode([i for i in row[keep == 1].tolist() if i not in ends])
                     for row, keep in zip(done.completion_ids.cpu(), done.completion_mask.cpu())]
            rewards = self.rewards.per_function([self.prompts[i] for i in prompts], texts,
                                                {k: [v[i] for i in prompts] for k, v in self.columns.items()})
        if mesh is not None:
            rewards = mesh.share_within_replica(rewards.to(done.logps.device))
        return rewards.cpu()

    def _counts(self, module: Any, done: Rollout, accumulation: int) -> Tensor:
        """``[3]`` float64: the step's completions and completion tokens (every replica; completions times the
        accumulated batches, each as large), and this batch's completion tokens (``bnpo``'s count)."""
        mesh = getattr(module.trainer.strategy, "mesh", None)
        mine = done.completion_mask.sum().to(torch.float64)
        every = torch.stack([torch.tensor(float(len(done.completion_ids)), dtype=torch.float64, device=mine.device),
                             mine])
        if mesh is not None:
            every = mesh.sum_over_batches(every)
        return torch.stack([every[0] * accumulation, every[1], mine])

    def _measure(self, module: Any, rewards: Tensor, total: Tensor, std: Tensor, done: Rollout) -> None:
        """TRL's rollout metrics of this batch: ``reward``, ``reward_std``, ``rewards/<name>/mean``,
        ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``."""
        lengths = done.completion_mask.sum(-1)
        clipped = (lengths == self.settings.max_completion_length) & (done.completion_mask[:, -1] == 1)
        self.metrics = {"reward": torch.nanmean(total), "reward_std": torch.nanmean(std),
                        "frac_reward_zero_std": (std == 0).double().mean(),
                        "completions/mean_length": lengths.double().mean(),
                        "completions/clipped_ratio": clipped.double().mean(),
                        **{f"rewards/{name}/mean": torch.nanmean(rewards[:, j])
                           for j, name in enumerate(self.rewards.names)}}


def _row_multiple(strategy: Any) -> int:
    """What the training forward's rows are padded to: positions that restart at 0 (left padding) are attended as
    packed documents, in two halves of the row, over t ranks under sequence parallelism: 2·t (labels -100 there)."""
    layout = getattr(strategy, "layout", None)
    return 2 * (layout.tp if layout is not None and layout.sequence_parallel else 1)
