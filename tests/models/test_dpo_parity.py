"""DPO trains like one process computing the same formula with plain transformers (float64, 3 steps): the logged loss
of every micro-batch and every trainable gradient of each step equal one process's at the run's weights of that step
(the gradient of the mean DPO loss over the step's pairs), with no host sync in the steps after the first, under

- LoRA at tp 2 (sequence parallel) × dp 2 with 2 accumulated micro-batches, the reference the frozen base with the
  adapters switched off in the same step;
- LoRA at tp 2 × cp 2, the LM head and loss over chunks of 4 positions;
- full fine-tuning at pp 2 × tp 2 with 2 micro-batches, the reference computed first by a reference pass through the
  same layout (its values equal one process's log-probabilities of the starting model);
- full fine-tuning of a mixture of experts (Qwen3-MoE, 8 experts, top 2) at tp 2 × ep 2, dense weights over 2
  data-parallel replicas;
- LoRA at pp 2 × tp 2 with 2 micro-batches, the reference the frozen base with the adapters off, made in each step by
  a forward-only schedule before the step's (the module's ``reference_step``), no reference pass;
- packed pairs (several whole pairs a row, attention kept to each reply, per-reply sums from the loss): LoRA at tp 2 ×
  dp 2 with 2 accumulated micro-batches, LoRA at tp 2 × cp 2 with the loss over chunks of 4 positions, full fine-tuning
  at pp 2 × tp 2 with its reference pass, LoRA at pp 2 × tp 2 with the reference in its own schedule — against one
  process computing each pair from its own padded rows.

At LoRA's first step (B = 0) the policy is the reference: every pair's loss is ln 2 and its rewards 0, exactly. The
reference pass gives the same values at tp 1, tp 2, pp 2 and cp 2 (to rounding; see its test)."""

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_seqpar import HostSyncCounter, SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_gradients
from lightning_seqpar.data.preference_datamodule import PairBatches, PreferenceDataModule
from lightning_seqpar.models.dpo_reference import compute_reference_logps
from lightning_seqpar.models.finetune import FineTuneModule
from tests.helpers.chat_tokenizer import chat_tokenizer, make_chat_model_dir
from tests.helpers.hf_models import moe_config
from tests.helpers.distributed import run_distributed
from tests.helpers.models import merge_over_stages
from tests.helpers.preference import write_preferences
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

STEPS, BATCH, BLOCK, BETA, LR = 3, 2, 32, 0.5, 1e-2
PACKED_BLOCK = 48  # two or three pairs a row (an empty slot in some)
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
LAYOUTS = {  # name: (strategy, accumulate, lora, model directory, packed)
    "lora tp2 x dp2, accumulate 2": ({"tp": 2}, 2, True, "model", False),
    "lora tp2 x cp2, loss chunks of 4": ({"tp": 2, "cp": 2, "loss_chunk": 4}, 1, True, "model", False),
    "full pp2 x tp2": ({"tp": 2, "pp": 2, "num_microbatches": 2}, 1, False, "model", False),
    "full qwen3-moe tp2 x ep2 (dp 2)": ({"tp": 2, "ep": 2}, 1, False, "moe", False),
    "lora pp2 x tp2, reference in the step": ({"tp": 2, "pp": 2, "num_microbatches": 2}, 1, True, "model", False),
    "packed lora tp2 x dp2, accumulate 2": ({"tp": 2}, 2, True, "model", True),
    "packed lora tp2 x cp2, loss chunks of 4": ({"tp": 2, "cp": 2, "loss_chunk": 4}, 1, True, "model", True),
    "packed full pp2 x tp2": ({"tp": 2, "pp": 2, "num_microbatches": 2}, 1, False, "model", True),
    "packed lora pp2 x tp2, reference in the step": ({"tp": 2, "pp": 2, "num_microbatches": 2}, 1, True, "model", True),
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    make_chat_model_dir(root / "model")
    _make_moe_dir(root / "moe")
    write_preferences(root / "pairs.jsonl", 40)
    return root


def _make_moe_dir(directory):
    """A tiny Qwen3-MoE (8 experts, top 2, every layer a mixture) with the chat tokenizer: a mixture's directory."""
    from transformers import AutoModelForCausalLM

    tokenizer = chat_tokenizer()
    config = moe_config("qwen3_moe", dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                          bos_token_id=None))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _batch(strategy, packed):
    """Pairs a micro-batch; packed: rows (one, or two to cut into the pipeline's two micro-batches)."""
    return (2 if strategy.get("pp", 1) > 1 else 1) if packed else BATCH


def _data(directory, packed=False, batch=BATCH):
    return PreferenceDataModule(str(directory / "pairs.jsonl"), str(directory / "model"),
                                PACKED_BLOCK if packed else BLOCK, batch, val_fraction=0.2, packing=packed)


class _Record(pl.Callback):
    def __init__(self, lora):
        self.lora, self.grads, self.first, self.logged, self.states = lora, [], None, [], []

    def on_train_start(self, trainer, pl_module):
        self.initial = trainer.strategy.full_state_dict()  # collective; the run's LoRA initialization

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # The first micro-batch's terms, unsynchronized, before any step (a split model runs only in its schedule).
        if self.lora and self.first is None and trainer.strategy.pp == 1:
            with torch.no_grad():
                self.first = pl_module.preference.terms(pl_module.model, batch, False)[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(trainer.callback_metrics["train/loss"].item())  # synchronized over the data-parallel ranks

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.states.append(trainer.strategy.full_state_dict())  # collective: the weights these gradients are of
        mesh = trainer.strategy.mesh
        self.grads.append(merge_over_stages(full_gradients(pl_module, mesh), mesh.pipeline))


def _fit(rank, world_size, directory, layout):
    strategy, accumulate, lora, model, packed = LAYOUTS[layout]
    record, syncs = _Record(lora), HostSyncCounter()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=STEPS, logger=False,
                         strategy=strategy_of(**strategy), accumulate_grad_batches=accumulate,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, check_val_every_n_epoch=None, val_check_interval=1000,
                         callbacks=[record, syncs])
    module = FineTuneModule(str(directory / model), LORA if lora else None, objective="dpo", dpo_beta=BETA,
                            learning_rate=LR, warmup_steps=0, weight_decay=0.0)
    data = _data(directory, packed, _batch(strategy, packed))
    reference = None
    if not lora:
        reference = data.reference = compute_reference_logps(trainer, module, data)
    trainer.fit(module, datamodule=data)
    validated = None
    if (lora and strategy.get("pp", 1) > 1) or packed:  # validation's reference from its own schedule; packed rows
        trainer.validate(module, datamodule=data, verbose=False)
        validated = trainer.callback_metrics["val/loss"].item(), trainer.strategy.full_state_dict()
    return record.states, record.grads, record.first, reference, record.logged, syncs.per_step, validated


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, directory):
    return request.param, run_distributed(_fit, 4, directory, request.param)[0]


def _policy(directory, state, lora):
    from peft import LoraConfig, get_peft_model
    from lightning_seqpar._compat import use_eager_experts
    from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config, pretrained_state_dict

    config = causal_lm_config(None, str(directory), "eager")
    use_eager_experts(config)  # expert by expert: transformers' grouped kernel does not take float64
    model = build_causal_lm(config)
    model.load_state_dict(pretrained_state_dict(str(directory)))
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA["target_modules"]))
    model = model.double()
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    return model


def _logps(model, batch):
    """Σ log p of each row's reply tokens, from the whole logits (what one process computes)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    tokens = logits.log_softmax(-1).gather(-1, shifted.clamp_min(0)[..., None])[..., 0]
    return (tokens * (shifted != -100)).sum(-1)


def _dpo(policy, reference):
    z = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    return -F.logsigmoid(BETA * z)


def _relative(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _pairs_of(batch, padded_rows):
    """A packed micro-batch's pairs as one process's padded rows (``2i`` chosen, ``2i+1`` rejected), with the batch's
    reference log-probabilities of them when it carries some."""
    index = batch["pair_index"]
    pairs = index[index >= 0]
    out = {k: torch.from_numpy(getattr(padded_rows, k)[pairs.numpy()].reshape(2 * len(pairs), -1))
           for k in ("input_ids", "labels", "attention_mask")}
    if "reference_logps" in batch:
        out["reference_logps"] = batch["reference_logps"].view(*index.shape, 2)[index >= 0].reshape(-1)
    return out


def test_every_gradient_is_one_process_mean_dpo_loss_over_each_steps_pairs(directory, run):
    layout, (states, grads, first, reference, logged, host_syncs, validated) = run
    strategy, accumulate, lora, model_dir, packed = LAYOUTS[layout]
    # The DPO step reads nothing back (the first exchanges the pipeline's shapes), but for a dropless mixture's one
    # read of its split sizes per layer (2 layers), as every dropless mixture's step.
    expected = 2 if model_dir == "moe" else 0
    assert len(host_syncs) == STEPS * accumulate and host_syncs[1:] == [expected] * (len(host_syncs) - 1), layout
    dp = 4 // (strategy.get("tp", 1) * strategy.get("cp", 1) * strategy.get("pp", 1))
    data = _data(directory)  # one process: one reply a row, padded
    data.setup()
    rows_run = data.train_rows
    if packed:
        packed_data = _data(directory, True)
        packed_data.setup()
        rows_run = packed_data.train_rows
        assert rows_run.pair_index.shape[1] > 1  # several pairs a row
    model = _policy(directory / model_dir, states[0], lora)
    if not lora:  # the reference pass through the layout: one process's log-probabilities of the starting model
        with torch.no_grad():
            rows = data.train_rows
            everything = {k: torch.from_numpy(getattr(rows, k).reshape(2 * len(rows), -1))
                          for k in ("input_ids", "labels", "attention_mask")}
            want = _logps(model, everything).view(-1, 2).numpy()
        # packed: the replies' attention kept apart by the document-aware blocks, whose softmax is float64 where
        # transformers' eager attention takes it in float32 (as under cp)
        assert reference["training"].shape == want.shape
        assert abs(reference["training"] - want).max() < (1e-6 if packed else 1e-9)
    ranks = [PairBatches(rows_run, _batch(strategy, packed), dp, q, accumulate, seed=0,
                         reference=None if lora else reference["training"]) for q in range(dp)]
    for step in range(STEPS):
        # Each step's gradients at the run's own weights of that step: a reference stepping on its own would
        # amplify rounding through Adam's normalized updates (gradients that start at 0, LoRA's A after B = 0).
        model.load_state_dict({k[len("model."):]: v for k, v in states[step].items()})
        model.zero_grad()
        for m in range(accumulate):
            batches = [ranks[q][(0, step * accumulate + m)] for q in range(dp)]
            pairs = int(batches[0]["num_items_in_step"][0])
            if packed:  # each pipeline micro-batch's rows (one cut of the batch's rows per micro-batch)
                assert pairs == sum(int((ranks[q][(0, step * accumulate + a)]["pair_index"] >= 0).sum())
                                    for q in range(dp) for a in range(accumulate))
                cuts = strategy.get("num_microbatches", 1)
                batches = [_pairs_of({k: v.chunk(cuts)[c] for k, v in batch.items()}, data.train_rows)
                           for batch in batches for c in range(cuts)]
            else:
                assert pairs == dp * accumulate * BATCH
            means = []
            for batch in batches:  # the mean over the whole step's pairs, as one process computes it
                if lora:
                    with torch.no_grad(), model.disable_adapter():
                        ref = _logps(model, batch)
                else:
                    ref = batch["reference_logps"]
                losses = _dpo(_logps(model, batch), ref)
                (losses.sum() / pairs).backward()
                means.append(losses.mean().item())
            # train/loss: the micro-batch's mean over its pairs, averaged over the data-parallel ranks (and packed, the
            # pipeline's micro-batches: their pairs differ in number, and each is weighed as one)
            want_loss = sum(means) / len(means)
            assert logged[step * accumulate + m] == pytest.approx(
                want_loss, rel=1e-7 if "cp" in strategy or packed else 1e-12)
        want = {"model." + n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        got = grads[step]
        assert got.keys() == want.keys() and len(want) == (2 * 5 * 2 if lora else len(list(model.parameters())))
        # Within 1e-10, or 1e-6 under cp: transformers' eager attention (the reference) takes its softmax in float32
        # even in a float64 model, as the rewritten core attention does, while the context-parallel blocks accumulate
        # in float64 (the log-probabilities differ by ~1e-9 relative).
        bound = 1e-6 if strategy.get("cp", 1) > 1 or packed else 1e-10
        wrong = {n: e for n in want if (e := _relative(got[n], want[n])) > bound and want[n].norm() > 0}
        assert wrong == {}, (layout, step, wrong)
        assert all(torch.equal(got[n], want[n]) for n in want if want[n].norm() == 0)  # B = 0 at first: A's grad 0
    assert not any(torch.equal(states[0][n], states[-1][n]) for n in want)  # every trainable weight moved
    if lora:  # B = 0: policy and reference are the same function of the same weights
        assert logged[0] == math.log(2)
    if validated is not None:  # pipelined LoRA: validation's reference in its own schedule as well; packed rows
        _check_validation(directory, validated, lora, None if lora else reference["validation"], packed)
    if first is not None:
        assert torch.equal(first.losses, torch.full_like(first.losses, math.log(2)))
        assert torch.equal(first.chosen_rewards, torch.zeros_like(first.chosen_rewards))
        assert torch.equal(first.rejected_rewards, torch.zeros_like(first.rejected_rewards))


def _reference_pass(rank, world_size, directory, strategy):
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", logger=False,
                         strategy=strategy_of(**strategy), enable_progress_bar=False,
                         enable_model_summary=False)
    module = FineTuneModule(str(directory / "model"), None, objective="dpo")
    return compute_reference_logps(trainer, module, _data(directory))


def test_the_reference_pass_gives_the_same_values_under_every_layout(directory):
    """pp 2 bit for bit, tp 2 within float64 rounding (the log-sum-exp over the vocabulary's shards adds in another
    order), cp 2 within 1e-8: its blocks take the softmax in float64, where the rewritten core attention follows
    transformers' eager attention (float32 softmax, even in a float64 model). Not bit-identical across every layout:
    the cache's identity leaves the layout out, so one computed under one layout is read under any other."""
    values = {name: run_distributed(_reference_pass, world, directory, strategy)[0]
              for name, world, strategy in (("tp1", 1, {}), ("tp2", 2, {"tp": 2}),
                                            ("pp2", 2, {"pp": 2, "num_microbatches": 2}), ("cp2", 2, {"cp": 2}))}
    for split in ("training", "validation"):
        one = values["tp1"][split]
        assert one.shape == ((32, 2) if split == "training" else (8, 2)) and (one < 0).all()
        assert np.array_equal(values["pp2"][split], one)
        assert abs(values["tp2"][split] / one - 1).max() < 1e-13  # the vocabulary's log-sum-exp over two shards
        assert abs(values["cp2"][split] / one - 1).max() < 1e-8


def _check_validation(directory, validated, lora=True, reference=None, packed=False):
    """val/loss of the run's final weights equals one process's mean DPO loss over the held-out pairs (packed: the
    rows fill whole batches with empty rows, which weigh nothing)."""
    val_loss, state = validated
    data = _data(directory)
    data.setup()
    model = _policy(directory / "model", state, lora)
    rows = data.val_rows
    everything = {k: torch.from_numpy(getattr(rows, k).reshape(2 * len(rows), -1))
                  for k in ("input_ids", "labels", "attention_mask")}
    with torch.no_grad():
        if lora:
            with model.disable_adapter():
                ref = _logps(model, everything)
        else:
            ref = torch.from_numpy(reference).reshape(-1)
        losses = _dpo(_logps(model, everything), ref)
    assert len(rows) == 8 and val_loss == pytest.approx(losses.mean().item(), rel=1e-7 if packed else 1e-10)
    assert val_loss != pytest.approx(math.log(2), rel=1e-3)  # trained: policy and reference differ
