"""GRPO's rewards: the built-ins score what they say, a user's function is found by its path and called with TRL's
signature, the weighted total follows TRL (``None`` scores nothing), and what cannot be scored is refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_seqpar.models.grpo_rewards import Rewards, reward_function

PROMPTS = ["2+2?", "Half of 1?", "Capital of France?"]
COMPLETIONS = ["It is 4.", "\\boxed{\\frac{1}{2}}", "Paris"]
ANSWERS = ["4", "0.5", "Paris"]


def length_reward(prompts, completions, **columns):
    """A user's reward: the completion's length (and it sees the dataset's columns)."""
    assert set(columns) == {"answer", "level"}
    return [float(len(c)) for c in completions]


def unscorable(prompts, completions, **columns):
    return [None, 1.0, None]


def raises_on_paris(prompts, completions, **columns):
    return [1.0 / (c != "Paris") for c in completions]


def test_the_built_ins_score_what_they_say():
    rewards = Rewards(["contains", "exact_match", "math"])
    scores = rewards.per_function(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    assert scores[:, 0].tolist() == [1.0, 0.0, 1.0]  # contains
    assert scores[:, 1].tolist() == [0.0, 0.0, 1.0]  # exact_match
    assert scores[:, 2].tolist() == [1.0, 1.0, 0.0]  # math: 4 and 1/2 = 0.5; "Paris" is no number
    conversational = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert torch.equal(rewards.per_function(PROMPTS, conversational, {"answer": ANSWERS}), scores)


def test_a_user_function_by_its_path_and_the_weighted_total():
    rewards = Rewards(["contains", "tests.models.test_grpo_rewards:length_reward", unscorable], weights=[2.0, 0.5, 1.0])
    assert rewards.names == ["contains", "tests.models.test_grpo_rewards:length_reward", "unscorable"]
    scores = rewards.per_function(PROMPTS, COMPLETIONS, {"answer": ANSWERS, "level": [1, 2, 3]})
    assert math.isnan(scores[0, 2]) and scores[1, 2] == 1.0
    total = rewards.total(scores)
    assert total.tolist() == [2.0 + 0.5 * 8, 0.5 * 19 + 1.0, 2.0 + 0.5 * 5]
    only = Rewards([unscorable]).total(Rewards([unscorable]).per_function(PROMPTS, COMPLETIONS, {}))
    assert math.isnan(only[0]) and only[1] == 1.0  # every function returned None: unscorable (TRL: NaN)


def test_what_cannot_be_scored_is_refused_by_name():
    with pytest.raises(ValueError, match="grpo.reward='nope'"):
        reward_function("nope")
    with pytest.raises(ValueError, match="grpo.reward='tests.models.test_grpo_rewards:absent'"):
        reward_function("tests.models.test_grpo_rewards:absent")
    with pytest.raises(TypeError, match="grpo.reward='tests.models.test_grpo_rewards:ANSWERS' is a list"):
        reward_function("tests.models.test_grpo_rewards:ANSWERS")
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        Rewards(["contains"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"grpo.reward=contains compares with the 'answer' column.*\['question'\]"):
        Rewards(["contains"]).check_columns(["question"])
    with pytest.raises(ValueError, match="reward short returned 2 rewards for 3 completions"):
        def short(prompts, completions, **columns):
            return [1.0, 1.0]
        Rewards([short]).per_function(PROMPTS, COMPLETIONS, {})
    with pytest.raises(ValueError, match="reward text returned 'yes' for row 0"):
        def text(prompts, completions, **columns):
            return ["yes"] * len(completions)
        Rewards([text]).per_function(PROMPTS, COMPLETIONS, {})
    with pytest.raises(RuntimeError, match=r"reward raises_on_paris raised ZeroDivisionError.*row 2: prompt "
                                           r"'Capital of France\?'"):
        Rewards([raises_on_paris]).per_function(PROMPTS, COMPLETIONS, {})
