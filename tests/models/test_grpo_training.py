"""A GRPO step in the training layout is one process's: the rollouts (each completion from its own seeded generator),
the rewards, the advantages and the step's counts do not depend on the layout, so one optimizer step (SGD, learning
rate 1: the weights move by minus the gradient) leaves every weight where the one-process step leaves it, at tp 2
(with sequence parallelism), dp 2 (each replica half the prompts), pp 2 (the completions split over the pipeline's
micro-batches) and tp 2 × dp 2 (``dapo``; the others at the layouts their definitions are invariant to). Float64."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_seqpar.hf.vocabulary import CausalLMLoss
from lightning_seqpar.models.grpo_objective import GRPOObjective, GRPOSettings
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

PROMPTS = [[0, 0, 5, 3], [4, 1, 2, 9], [0, 7, 7, 1], [11, 6, 2, 8]]
ANSWERS = ["3", "9", "1", "4"]
END = 7


def threes(prompts, completions, answer, **columns):
    """A verifiable reward with spread: how often the completion says the prompt's answer."""
    return [float(completion.split().count(a)) for completion, a in zip(completions, answer)]


class GRPOModule(pl.LightningModule):
    def __init__(self, loss_type: str, beta: float = 0.0) -> None:
        super().__init__()
        self.model = build("hf", labels=True, attn_implementation="sdpa").model
        self.model.loss_function = CausalLMLoss(self.model.loss_function)  # per-token log-probabilities
        if beta:  # the KL term's reference: the base, LoRA's adapters off
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj",
                                                                                                 "down_proj"],
                                                               init_lora_weights=False))  # B drawn: the two differ
        settings = GRPOSettings(num_generations=3, max_completion_length=5, loss_type=loss_type, reward=[threes],
                                seed=1, beta=beta)
        self.grpo = GRPOObjective(settings, lambda ids: " ".join(map(str, ids)), PROMPTS, {"answer": ANSWERS},
                                  eos_token_id=END)

    def on_train_batch_start(self, batch, batch_idx):
        self.grpo.roll_out(self, batch)

    def training_step(self, batch, batch_idx):
        return self.grpo.loss(self, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _data(replicas: int) -> DataLoader:
    rows = [dict(input_ids=torch.tensor(p), attention_mask=(torch.tensor(p) != 0).long() if p[0] == 0 else
                 torch.ones(4, dtype=torch.long), prompt_index=torch.tensor(i)) for i, p in enumerate(PROMPTS)]
    return DataLoader(rows, batch_size=len(PROMPTS) // replicas)


def _step(rank, world, layout, loss_type, accumulation=1, beta=0.0):  # (before, after, the rollout's metrics)
    torch.manual_seed(0)
    module = GRPOModule(loss_type, beta)
    strategy = strategy_of(**dict(layout)) if layout else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=1, logger=False,
                         accumulate_grad_batches=accumulation,
                         strategy=strategy, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    replicas = world // dict(layout).get("tp", 1) // dict(layout).get("pp", 1) if layout else 1
    trainer.fit(module, _data(replicas * accumulation))
    after = trainer.strategy.full_state_dict() if layout else module.state_dict()
    return before, after, {k: float(v) for k, v in {**module.grpo.metrics, **module.grpo.loss_metrics}.items()}


LAYOUTS = [(2, (("tp", 2),)), (2, (("pp", 2),)), (4, (("tp", 2), ("pp", 1)))]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_a_grpo_step_moves_every_weight_as_one_process_does(loss_type):
    before, want, metrics = run_distributed(_step, 1, None, loss_type)[0]
    moved = max((want[k] - before[k]).abs().max().item() for k in want)
    assert moved > 1e-3  # the rewards differ within groups: a gradient
    assert metrics["reward_std"] > 0 and 0 < metrics["completions/mean_length"] <= 5
    # dapo: every layout; grpo and dr_grpo: tp 2 and dp 2; bnpo, the mean of each replica's token mean (TRL's), is
    # invariant to tp and pp, not to the data-parallel split: tp 2 and pp 2
    layouts = {"dapo": LAYOUTS, "bnpo": LAYOUTS[:2]}.get(loss_type, LAYOUTS[:1] + [(2, (("tp", 1),))])
    for world, layout in layouts:
        for _, got, _ in run_distributed(_step, world, layout, loss_type):
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-10, (loss_type, layout, worst)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_gradient_accumulation_gives_the_step_of_one_batch(loss_type):
    """Two accumulated batches of two prompts each: the step of one batch of four (their counts are the step's)."""
    _, want, _ = run_distributed(_step, 1, None, loss_type)[0]
    _, got, _ = run_distributed(_step, 1, None, loss_type, 2)[0]
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-10


def _refused(rank, world):
    try:
        _step(rank, world, None, "dapo", 2)
    except ValueError as error:
        return str(error)
    return ""


def test_dapo_under_gradient_accumulation_is_refused_with_the_fix():
    message = run_distributed(_refused, 1)[0]
    assert "grpo.loss_type=dapo normalises by the step's completion tokens" in message
    assert "accumulate_grad_batches=2" in message and "pipeline micro-batches" in message


def test_the_kl_term_s_reference_is_the_base_with_the_adapters_off_at_every_layout():
    """beta > 0 with LoRA: the reference's log-probabilities are taken at rollout time with the adapters off (under
    pp through the stages in order); the step equals one process's at tp 2 and pp 2."""
    before, want, metrics = run_distributed(_step, 1, None, "dapo", 1, 0.5)[0]
    assert metrics["kl"] > 0  # the adapters (B drawn) move the policy from the base
    adapters = [k for k in want if "lora_" in k]
    assert adapters and max((want[k] - before[k]).abs().max().item() for k in adapters) > 1e-3
    _, without, _ = run_distributed(_step, 1, None, "dapo", 1, 1e-12)[0]  # the same adapters, next to no KL
    assert max((want[k] - without[k]).abs().max().item() for k in adapters) > 1e-4  # the KL term pulls
    for world, layout in LAYOUTS[:2]:
        for _, got, _ in run_distributed(_step, world, layout, "dapo", 1, 0.5):
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-10, (layout, worst)
