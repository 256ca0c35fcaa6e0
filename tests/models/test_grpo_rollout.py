"""GRPO's rollouts in the training layout are one process's: after training under SeqParallelStrategy (tp 2 with
sequence parallelism, and tp 2 × dp 2 with each replica its own prompts), G completions of each left-padded prompt
drawn with a seeded generator are the one-process model's draws; the completion mask stops after each row's end token;
the training forward's per-token log-probabilities of the completions equal one process's, and the rollout's own
log-probabilities equal them within 1e-6 (the trainer/rollout mismatch). SDPA attention: transformers' eager kernel
in float64 gives NaN on a left-padded row, which the one-process reference would sample from."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar.hf.vocabulary import CausalLMLoss
from lightning_seqpar.models.grpo_rollout import policy_logps, rollout
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, loader, token_data
from tests.helpers.prompts import replica_prompts
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

G, NEW, END = 3, 6, 7


class _Rollout(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        replica = trainer.strategy.mesh.batch_rank
        prompts, mask = replica_prompts(replica)
        batch = rollout(pl_module, prompts, mask, G, NEW, temperature=0.9, generator=torch.Generator().manual_seed(5),
                        eos_token_id=END, pad_token_id=0)
        with torch.no_grad():
            trained = policy_logps(pl_module.model, batch, multiple=trainer.strategy.mesh.tensor.size)
        self.result = dict(state=trainer.strategy.full_state_dict(), replica=replica, batch=batch, trained=trained)


def _run(rank, world, tp):
    callback = _Rollout()
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=2, logger=False,
                         strategy=strategy_of(tp=tp), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(build("hf", labels=True, attn_implementation="sdpa"), loader(token_data(2, world // tp)))
    return callback.result


@pytest.mark.parametrize("world", [2, 4])
def test_rollouts_and_their_log_probabilities_are_one_process_s(world):
    per_rank = run_distributed(_run, world, 2)
    for result in per_rank:
        model = build("hf", labels=True, attn_implementation="sdpa").double()
        model.load_state_dict(result["state"])
        model.model.loss_function = CausalLMLoss(model.model.loss_function)  # per-token log-probabilities
        prompts, mask = replica_prompts(result["replica"])
        want = rollout(model.model, prompts, mask, G, NEW, temperature=0.9, generator=torch.Generator().manual_seed(5),
                       eos_token_id=END, pad_token_id=0)
        got = result["batch"]
        assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.prompt_ids, want.prompt_ids)
        assert torch.equal(got.completion_mask, want.completion_mask)
        with torch.no_grad():
            one_process = policy_logps(model.model, want)
        assert (result["trained"] - one_process).abs().max() < 1e-12
        assert (got.logps - result["trained"]).abs().max() < 1e-6  # the trainer/rollout mismatch
        assert bool((got.completion_mask == 0).any())  # some row ended before NEW tokens
    if world == 4:  # the replicas drew from different prompts
        assert not torch.equal(per_rank[0]["batch"].completion_ids, per_rank[2]["batch"].completion_ids)
