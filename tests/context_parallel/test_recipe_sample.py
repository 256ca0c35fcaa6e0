"""The main recipe's closing sample: under context parallelism each rank holds chunks of the sequence and the model
computes the loss, not whole-sequence logits, so the sample is drawn from the single-device model gathered from the
shards (before: "ParallelGPT under context parallelism computes the loss ..." and the job ended rc 1); under pipeline
parallelism it is generated in the training layout."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.models.gpt import GPTConfig
from lightning_seqpar.models.module import GPTLightningModule
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16)
SAMPLE = OmegaConf.create({"seed": 3, "sample": {"prompt": "", "max_new_tokens": 6, "temperature": 1.0,
                                                 "top_k": None}})


class _Ids:
    """What the recipe reads of its data module: a prompt's ids and their text."""

    def prompt(self, text: str) -> torch.Tensor:
        return torch.tensor([1, 2, 3])

    def decode(self, ids: torch.Tensor) -> str:
        return " ".join(str(int(i)) for i in ids)


def _sample_after_a_step(rank, world, layout=(("cp", 2),)):
    from recipes.pretrain_gpt import sample

    torch.manual_seed(0)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1))
    loader = DataLoader([(row[:-1], row[1:]) for row in data], batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=SeqParallelStrategy(**dict(layout)), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    module = GPTLightningModule(CONFIG)
    trainer.fit(module, loader)
    state = trainer.strategy.full_state_dict()
    return sample(module, trainer, _Ids(), SAMPLE), state


def test_the_recipe_samples_under_context_parallelism_from_the_gathered_model():
    results = run_distributed(_sample_after_a_step, 2)
    (text, state), (other, _) = results
    assert text == other  # the same draws on every rank
    single = GPTLightningModule(CONFIG)
    single.load_state_dict(state)
    single.eval()
    generator = torch.Generator().manual_seed(SAMPLE.seed)
    want = single.gpt.generate(torch.tensor([[1, 2, 3]]), 6, 1.0, None, generator)[0]
    assert text == " ".join(str(int(i)) for i in want) and len(text.split()) == 9


def test_the_recipe_samples_in_the_pipeline_layout_what_generate_draws_on_one_process():
    """At pp 2 the sample is generated in the training layout (no gathered copy): the tokens of the same draws on the
    one-process model with the run's weights."""
    from lightning_seqpar import generate

    (text, state), (other, _) = run_distributed(_sample_after_a_step, 2, (("pp", 2),))
    assert text == other
    single = GPTLightningModule(CONFIG)
    single.load_state_dict(state)
    generator = torch.Generator().manual_seed(SAMPLE.seed)
    want = generate(single, torch.tensor([[1, 2, 3]]), 6, do_sample=True, generator=generator)[0]
    assert text == " ".join(str(int(i)) for i in want) and len(text.split()) == 9
