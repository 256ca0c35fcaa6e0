"""``generate`` on one process, the fast lane: greedy tokens equal transformers' ``generate`` on the same model, a
left-padded row continues as it would alone, and what it cannot take is refused by name before any forward."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar import generate
from tests.helpers.models import build

transformers = pytest.importorskip("transformers")

PROMPTS = torch.tensor([[0, 0, 5, 3, 7], [4, 1, 2, 9, 11]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def model():
    # SDPA: transformers' eager attention in float64 gives NaN on the rows of a left-padded prompt (a fully masked
    # query row), which generation reads nothing of but which its matmuls carry on into the row's real positions.
    model = build("hf", labels=True, attn_implementation="sdpa").double().model
    model.generation_config.eos_token_id = None  # transformers' rows run to max_new_tokens, as ours without one
    return model


def test_greedy_tokens_are_transformers_and_a_padded_row_continues_as_alone(model):
    got = generate(model, PROMPTS, 5, attention_mask=MASK)
    for row in range(2):
        alone = PROMPTS[row][MASK[row] == 1][None]
        want = model.generate(input_ids=alone, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(got[row, -5:], want[0, -5:]), (row, got, want)


def test_a_row_stops_at_its_end_token_and_is_padded_after(model):
    free = generate(model, PROMPTS[1:], 5)
    end = int(free[0, 6])  # the row's second new token
    got = generate(model, PROMPTS[1:], 5, eos_token_id=end, pad_token_id=0)
    assert torch.equal(got, free[:, :7])  # every row ended: no forward after the end token


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.zeros(5, dtype=torch.long)), r"input_ids of shape \(5,\)"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])), "pad on the left"),
    (dict(attention_mask=torch.ones(2, 4, dtype=torch.long)), r"attention_mask of shape \(2, 4\)"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(do_sample=True, temperature=0.0), "temperature=0.0")])
def test_what_generate_cannot_take_is_refused_by_name(model, kwargs, match):
    arguments = {**dict(input_ids=PROMPTS, max_new_tokens=3), **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, **arguments)


def test_sample_text_refuses_what_it_cannot_do_before_training():
    from types import SimpleNamespace

    from lightning_seqpar import Layout, SampleText

    with pytest.raises(ValueError, match="every_n_steps=0"):
        SampleText(["hi"], list, str, 0)
    callback = SampleText(["hi"], list, str, 2)
    trainer = SimpleNamespace(strategy=SimpleNamespace(layout=Layout(cp=2)))
    with pytest.raises(ValueError, match=r"context parallelism \(cp=2: a decoded position"):
        callback.on_fit_start(trainer, None)
    callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(layout=Layout(pp=2))), None)  # stages: generated


def test_the_reference_gpt_takes_prompts_of_one_length_and_a_non_causal_model_is_refused():
    from lightning_seqpar import RewriteContext, rewrite
    from lightning_seqpar.parallel import ParallelGroup
    from tests.helpers.models import EncoderLM

    gpt = build("gpt").double().gpt
    with pytest.raises(ValueError, match="GPT takes no attention mask, so its prompts cannot be left-padded"):
        generate(gpt, PROMPTS, 2, attention_mask=MASK)
    encoder = EncoderLM()
    rewrite(encoder, RewriteContext(ParallelGroup(), False, None, True))
    with pytest.raises(ValueError, match=r"blocks declared non-causal \(encoder.layers.0"):
        generate(torch.nn.ModuleDict({"encoder": encoder.encoder}), PROMPTS, 2)  # a user's model holding it


def test_tokens_come_from_the_forward_training_runs_under_mixed_precision():
    """Under ``bf16-mixed`` the trainer's autocast applies to generation as to the training step: the log-probabilities
    are the autocast forward's, not a float32 forward's."""
    import lightning.pytorch as pl

    from tests.helpers.models import loader, token_data

    class Generate(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            self.tokens, self.logprobs = generate(pl_module, PROMPTS[1:], 3, return_logprobs=True)

    callback = Generate()
    module = build("hf", labels=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(module, loader(token_data(1, 1)))
    tokens = callback.tokens

    def logprobs(autocast: bool):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            scores = module.model(input_ids=tokens).logits.float().log_softmax(-1)[0, -4:-1]
        return scores.gather(-1, tokens[0, -3:, None]).squeeze(-1)

    assert torch.equal(callback.logprobs[0], logprobs(True))
    assert (callback.logprobs[0] - logprobs(False)).abs().max() > 1e-4
