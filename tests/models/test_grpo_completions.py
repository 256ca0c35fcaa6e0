"""GRPO's completion mask and the rollout's refusals, on one process."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.models.grpo_rollout import completion_mask, rollout
from tests.helpers.models import build


def test_the_completion_mask_keeps_each_row_through_its_first_end_token():
    completions = torch.tensor([[3, 7, 5, 7], [1, 2, 3, 4], [7, 0, 0, 0]])
    assert completion_mask(completions, [7]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert completion_mask(completions, []).tolist() == [[1.0] * 4] * 3


def test_a_model_whose_loss_is_not_per_token_is_refused_with_the_fix():
    from lightning_seqpar.models.grpo_rollout import Rollout, policy_logps

    model = build("hf", labels=True).double().model
    ones = torch.ones(2, 3, dtype=torch.long)
    batch = Rollout(ones, ones, ones, ones.float(), ones.float(), 2)
    with pytest.raises(ValueError, match=r"loss of shape \(\) for token_logps=True.*CausalLMLoss\(model.loss_function"):
        policy_logps(model, batch)


def test_with_a_seed_per_prompt_a_completion_s_draws_do_not_depend_on_its_batch():
    """The step's prompts split over replicas or micro-batches draw the samples they draw together: each completion
    from its own generator (its prompt's seed and its index in the group)."""
    model = build("hf", labels=True, attn_implementation="sdpa").double().model
    prompts, mask = torch.tensor([[0, 0, 5, 3, 7], [4, 1, 2, 9, 11]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    together = rollout(model, prompts, mask, 3, 6, temperature=1.5, seeds=[10, 11])
    first = rollout(model, prompts[:1, 2:], mask[:1, 2:], 3, 6, temperature=1.5, seeds=[10])
    second = rollout(model, prompts[1:], mask[1:], 3, 6, temperature=1.5, seeds=[11])
    assert torch.equal(together.completion_ids[:3], first.completion_ids)
    assert torch.equal(together.completion_ids[3:], second.completion_ids)
    assert len({tuple(row.tolist()) for row in together.completion_ids}) > 2  # the draws differ within a group
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        rollout(model, prompts, mask, 3, 6, seeds=[10])


def test_fewer_than_two_generations_per_prompt_is_refused():
    model = build("hf", labels=True).double().model
    prompts, mask = torch.tensor([[4, 1, 2]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="grpo.num_generations=1: GRPO compares G >= 2"):
        rollout(model, prompts, mask, 1, 4)


def test_the_kl_term_without_lora_is_refused_with_the_fix():
    from types import SimpleNamespace

    from lightning_seqpar.models.grpo_objective import GRPOObjective, GRPOSettings

    objective = GRPOObjective(GRPOSettings(beta=0.1), str, ["p"], {"answer": ["a"]}, eos_token_id=2)
    module = SimpleNamespace(model=build("hf", labels=True).model)
    with pytest.raises(ValueError, match="grpo.beta=0.1: the KL term's reference is the base with LoRA's adapters off"):
        objective._reference(module, None)


def test_the_rewards_read_each_completion_without_its_end_token():
    """TRL decodes completions skipping special tokens: exact_match sees "four", not "four <|end|>"."""
    from types import SimpleNamespace

    from lightning_seqpar.models.grpo_objective import GRPOObjective, GRPOSettings
    from lightning_seqpar.models.grpo_rollout import Rollout

    words = {3: "four", 4: "five", 2: "<|end|>", 0: "<pad>"}
    objective = GRPOObjective(GRPOSettings(num_generations=2, reward=["exact_match"]),
                              lambda ids: " ".join(words[i] for i in ids), ["q"], {"answer": ["four"]}, eos_token_id=2)
    completions = torch.tensor([[3, 2, 0], [4, 2, 0]])
    done = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), completions,
                   completion_mask(completions, [2]), torch.zeros(2, 3), 2)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace()))
    assert objective._scored(module, done, [0, 0]).squeeze(-1).tolist() == [1.0, 0.0]
