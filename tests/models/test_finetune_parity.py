"""Fine-tuning as the recipe runs it trains like one process: a pretrained chat model's directory read into the
shards of a PEFT-wrapped model (adapters initialized by LoRA's rule on the meta device), conversations rendered with
its chat template and packed, tp 2 × dp 2 with 2 accumulated micro-batches: every adapter's gradient at each of 3
steps equals one process's gradient of the mean over the step's supervised tokens (all rows of all ranks and
micro-batches), and the validation loss equals one process's mean over the held-out supervised tokens. For a Llama,
and for a Qwen3-MoE with adapters on its experts too (``target_parameters``) at tp 2 × ep 2: the expert adapters
drawn whole by LoRA's rule and sliced with their experts."""


import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar.checkpoint.full_state import full_gradients, full_state_dict
from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule
from lightning_seqpar.data.step_batches import StepBatches
from lightning_seqpar.models.finetune import FineTuneModule
from tests.helpers.chat_tokenizer import make_chat_dir
from tests.helpers.distributed import run_distributed
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

STEPS, TP, DP, ACCUMULATE, BATCH, BLOCK = 3, 2, 2, 2, 2, 48
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
MOE_LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
KINDS = {"dense": (0, LORA, 1), "moe": (4, MOE_LORA, 2)}
"""(experts, LoRA settings, ep) of each model fine-tuned: a Llama; a Qwen3-MoE of 4 experts, adapted there too."""


class _Record(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.initial = full_state_dict(pl_module, trainer.strategy.mesh)
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(full_gradients(pl_module, trainer.strategy.mesh))

    def on_train_end(self, trainer, pl_module):
        self.final = full_state_dict(pl_module, trainer.strategy.mesh)


def _data(directory):
    return FineTuneDataModule(str(directory / "chat.jsonl"), str(directory / "model"), BLOCK, BATCH,
                              val_fraction=0.2)


def _fit(rank, world_size, directory, kind):
    _, lora, ep = KINDS[kind]
    record = _Record()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=STEPS, logger=False,
                         strategy=strategy_of(tp=TP, ep=ep), accumulate_grad_batches=ACCUMULATE,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, check_val_every_n_epoch=None, val_check_interval=1000,
                         callbacks=[record])
    module = FineTuneModule(str(directory / "model"), lora, learning_rate=1e-2, warmup_steps=0, weight_decay=0.0)
    data = _data(directory)
    trainer.fit(module, datamodule=data)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    trainer.limit_val_batches = 1  # the first validation step alone: its own tokens are the denominator
    first = trainer.validate(module, datamodule=data, verbose=False)[0]
    return record.initial, record.grads, record.final, (metrics["val/loss"], first["val/loss"])


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def directory(tmp_path_factory, kind):
    return make_chat_dir(tmp_path_factory.mktemp(f"chat_{kind}"), 160, experts=KINDS[kind][0])


@pytest.fixture(scope="module")
def parallel(directory, kind):
    return run_distributed(_fit, TP * DP, directory, kind)[0]


def _reference(directory, state, kind):
    """One process: PEFT on one device, the run's adapters loaded (float64; a mixture's experts one by one)."""
    from peft import get_peft_model

    from lightning_seqpar._compat import use_eager_experts
    from lightning_seqpar.checkpoint.peft_adapter import lora_config
    from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config, pretrained_state_dict
    from lightning_seqpar.models.finetune import LORA_DEFAULTS

    config = causal_lm_config(None, str(directory / "model"), "eager")
    use_eager_experts(config)
    model = build_causal_lm(config)
    model.load_state_dict(pretrained_state_dict(str(directory / "model")))
    model = get_peft_model(model, lora_config({**LORA_DEFAULTS, **KINDS[kind][1]})).double()
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    return model


def _inputs(batch):
    """The batch as the one-process model takes it: its eager attention would cross packed examples given position
    ids alone, so the reference is given the examples' causal mask (tests/helpers/hf_models.py does the same)."""
    inputs = {k: v for k, v in batch.items() if k != "num_items_in_step"}
    documents = (inputs["position_ids"] == 0).cumsum(-1)
    s = documents.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & (documents[:, :, None] == documents[:, None, :])
    inputs["attention_mask"] = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
        ~allowed, float("-inf"))[:, None]
    return inputs


def _relative(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def test_adapter_gradients_are_one_process_mean_over_each_steps_supervised_tokens(directory, parallel, kind):
    initial, grads, _, _ = parallel
    data = _data(directory)
    data.setup()
    model = _reference(directory, initial, kind)  # the adapters the run drew with LoRA's rule
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    ranks = [StepBatches(data.train_rows, BATCH, DP, q, ACCUMULATE, seed=0) for q in range(DP)]
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = [ranks[q][(0, step * ACCUMULATE + m)] for q in range(DP) for m in range(ACCUMULATE)]
        total = int(batches[0]["num_items_in_step"][0])
        assert total == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for batch in batches:  # the mean over the whole step's supervised tokens, as one process computes it
            model(**_inputs(batch), num_items_in_batch=total).loss.backward()
        want = {"model." + n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        got = grads[step]
        assert got.keys() == want.keys() and len(want) == 2 * 5 * 2  # dense: 5 projections; moe: 3 and 2 experts
        wrong = {n: e for n in want if (e := _relative(got[n], want[n])) > 1e-4 and want[n].norm() > 0}
        assert wrong == {}, (step, wrong)
        assert all(torch.equal(got[n], want[n]) for n in want if want[n].norm() == 0)  # B = 0 at first: A's grad 0
        optimizer.step()


def test_validation_loss_is_the_mean_over_the_held_out_supervised_tokens_of_the_batches_run(directory, parallel,
                                                                                            kind):
    _, _, final, (val_loss, first_loss) = parallel
    data = _data(directory)
    data.setup()
    model = _reference(directory, final, kind)
    rows = data.val_rows
    batch = min(BATCH, max(1, len(rows) // DP))
    steps = len(rows) // (DP * batch)
    assert steps >= 2  # limit_val_batches=1 then runs part of the split

    def mean_over(n_rows):  # one process's mean over the supervised tokens of the first n_rows held-out rows
        whole = StepBatches(rows, n_rows, 1, 0, 1, seed=0, shuffle=False, split="validation")[(0, 0)]
        with torch.no_grad():
            token_sum = model(**_inputs(whole), num_items_in_batch=1).loss
        return (token_sum / int(whole["num_items_in_step"][0])).item()

    assert val_loss == pytest.approx(mean_over(steps * DP * batch), rel=1e-6)  # whole micro-batches per rank
    assert first_loss == pytest.approx(mean_over(DP * batch), rel=1e-6)  # one step: every rank's first micro-batch
