"""DPO's parts on one process: preference records rendered and refused by line, pair rows and their batches, the loss
formulas, per-row log-probabilities from whole and from vocabulary-sharded, chunked logits, and the reference cache
(bit-exact round trip; damaged and foreign caches refused by name)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_seqpar.data.packing import IGNORE
from lightning_seqpar.data.preference import packed_pair_rows, pair_rows, render_pairs
from lightning_seqpar.data.preference_datamodule import PairBatches, PreferenceDataModule
from lightning_seqpar.hf.tokenizer import HFTokenizer
from lightning_seqpar.hf.vocabulary import CausalLMLoss
from lightning_seqpar.models.dpo import PreferenceLoss, document_tokens, dpo_terms, refuse_unsupported
from lightning_seqpar.models.dpo_reference import read_reference, write_reference
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.tensor_parallel.vocab_logits import VocabShardedLogits
from tests.helpers.chat_tokenizer import chat_tokenizer
from tests.helpers.preference import write_preferences


@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizer(chat_tokenizer(), "chat")


def _supervised_text(tokenizer, example):
    return tokenizer.decode([int(i) for i in example.ids[example.supervised]])


def test_text_pairs_supervise_the_reply_and_end_of_text_after_the_prompt(tokenizer):
    (pair,) = render_pairs([{"prompt": "is the sky blue", "chosen": "yes", "rejected": "no because"}], tokenizer,
                           ["pairs.jsonl:1"])
    prompt = len(tokenizer.encode_batch(["is the sky blue"])[0])
    for example, reply in ((pair.chosen, "yes"), (pair.rejected, "no because")):
        assert not example.supervised[:prompt].any() and example.supervised[prompt:].all()
        assert _supervised_text(tokenizer, example).replace(" ", "") == (reply + "<|end|>").replace(" ", "")


@pytest.mark.parametrize("explicit", [False, True])
def test_conversations_score_only_the_replies_after_the_shared_prompt(tokenizer, explicit):
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good morning"},
               {"role": "user", "content": "is the sky blue"}]
    chosen, rejected = [{"role": "assistant", "content": "yes"}], [{"role": "assistant", "content": "no"}]
    record = ({"prompt": history, "chosen": chosen, "rejected": rejected} if explicit else
              {"chosen": history + chosen, "rejected": history + rejected})
    (pair,) = render_pairs([record], tokenizer, ["pairs.jsonl:1"])
    assert _supervised_text(tokenizer, pair.chosen).replace(" ", "") == "yes<|end|>"  # not the earlier turn's
    assert _supervised_text(tokenizer, pair.rejected).replace(" ", "") == "no<|end|>"


@pytest.mark.parametrize("record, message", [
    ({"prompt": "a", "chosen": "b"}, "pairs.jsonl:7: ['chosen', 'prompt']; a preference record is"),
    ([1, 2], "pairs.jsonl:7: a JSON list; a preference record is"),
    ({"prompt": ["x"], "chosen": "yes", "rejected": "no"}, "\"prompt\" must be a text too"),
    ({"prompt": "hello", "chosen": "yes", "rejected": ["no"]}, "give all three as texts"),
    ({"prompt": "hello", "chosen": "yes", "rejected": "yes"}, "chosen and rejected replies are the same"),
])
def test_bad_records_are_refused_naming_the_line_and_the_fix(tokenizer, record, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render_pairs([record], tokenizer, ["pairs.jsonl:7"])


def test_pair_rows_pad_each_reply_and_refuse_or_truncate_overflow(tokenizer):
    pairs = render_pairs([{"prompt": "hello how are you", "chosen": "i am fine thanks", "rejected": "no"}] * 3,
                         tokenizer, [f"p:{i}" for i in range(3)])
    rows = pair_rows(pairs, 16, 1)
    assert rows.input_ids.shape == (3, 2, 16) and rows.attention_mask[0, 1].sum() == len(pairs[0].rejected)
    assert (rows.labels[rows.attention_mask == 0] == IGNORE).all()
    assert rows.reply_tokens[0].tolist() == [5, 2]  # "i am fine thanks" + end; "no" + end
    with pytest.raises(ValueError, match=r"p:0 \(chosen\): 9 tokens, longer than the block of 8"):
        pair_rows(pairs, 8, 1, names=["p:0", "p:1", "p:2"])
    truncated = pair_rows(pairs, 7, 1, "truncate")
    assert truncated.reply_tokens[0].tolist() == [3, 2]
    with pytest.raises(ValueError, match=r"p:0 \(chosen\): its first 4 tokens hold no reply token"):
        pair_rows(pairs, 4, 1, "truncate", ["p:0", "p:1", "p:2"])


def test_pair_batches_keep_pairs_together_and_count_the_steps_pairs(tokenizer):
    pairs = render_pairs([{"prompt": "hello", "chosen": "yes " * (i % 3 + 1), "rejected": "no"} for i in range(10)],
                         tokenizer, [f"p:{i}" for i in range(10)])
    rows = pair_rows(pairs, 8, 1)
    batches = PairBatches(rows, 2, 2, 1, 2, seed=0)  # dp 2 (rank 1), accumulate 2, 2 pairs per micro-batch
    batch = batches[(0, 1)]
    assert batch["input_ids"].shape == (4, 8) and batch["num_items_in_step"].tolist() == [8] * 4
    mine = batch["pair_index"][0::2]
    assert torch.equal(batch["pair_index"][1::2], mine)
    assert torch.equal(batch["input_ids"][0::2], torch.from_numpy(rows.input_ids[mine.numpy(), 0]))
    assert torch.equal(batch["input_ids"][1::2], torch.from_numpy(rows.input_ids[mine.numpy(), 1]))
    covered = PairBatches(rows, 2, 2, 0, 1, seed=0, shuffle=False, cover=True)
    seen = {int(i) for q in (0, 1) for k in range(len(covered))
            for i in PairBatches(rows, 2, 2, q, 1, 0, False, cover=True)[(0, k)]["pair_index"]}
    assert len(covered) == 3 and seen == set(range(10))  # 10 pairs in steps of 4: the last wraps around


def test_a_batch_size_the_pipeline_would_cut_is_refused_before_reading(tmp_path, tokenizer):
    data = PreferenceDataModule(str(write_preferences(tmp_path / "pairs.jsonl", 8)), tokenizer, 32, 3)
    pipeline = SimpleNamespace(config=SimpleNamespace(num_microbatches=2))
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(pipeline=pipeline), lightning_module=None)
    with pytest.raises(ValueError, match="data.batch_size=3 pairs cannot be cut into num_microbatches=2"):
        data.setup()


def test_a_bad_line_in_the_file_is_named(tmp_path, tokenizer):
    path = write_preferences(tmp_path / "pairs.jsonl", 4)
    path.write_text(path.read_text() + '{"prompt": "x", "chosen": "yes"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:5: \['chosen', 'prompt'\]"):
        PreferenceDataModule(str(path), tokenizer, 32, 2).setup()


def test_the_losses_are_dpo_and_ipo_and_equal_policy_and_reference_give_ln_2():
    pc, pr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0],
                                                                        [-3.0, -3.0]))
    z = (pc - rc) - (pr - rr)
    terms = dpo_terms(pc, pr, rc, rr, beta=0.5)
    assert torch.allclose(terms.losses, torch.log1p(torch.exp(-0.5 * z)), rtol=1e-15)
    assert torch.equal(terms.chosen_rewards, 0.5 * (pc - rc)) and torch.equal(terms.rejected_rewards, 0.5 * (pr - rr))
    assert torch.allclose(dpo_terms(pc, pr, rc, rr, 0.5, "ipo").losses, (z - 1.0) ** 2, rtol=1e-15)
    same = dpo_terms(pc, pr, pc, pr, beta=0.1)
    assert torch.equal(same.losses, torch.full_like(pc, math.log(2))) and not same.chosen_rewards.any()
    metrics = PreferenceLoss.metrics(terms, torch.stack([pc, pr], 1).flatten())
    assert metrics["rewards/accuracies"] == 0.5 and metrics["logps/chosen"] == -4.0
    with pytest.raises(ValueError, match="dpo.loss='hinge': one of"):
        dpo_terms(pc, pr, rc, rr, 0.1, "hinge")
    with pytest.raises(ValueError, match="dpo.beta=0: β must be positive"):
        PreferenceLoss(0, "sigmoid", True)


def test_a_mixture_recording_its_router_loss_is_refused_for_dpo_only():
    config = SimpleNamespace(model_type="qwen3_moe", output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=False"):
        refuse_unsupported(config, "dpo")
    refuse_unsupported(config, "sft")


def test_packed_rows_hold_whole_pairs_side_by_side_with_positions_restarting_at_each_reply(tokenizer):
    pairs = render_pairs([{"prompt": "hello", "chosen": "yes " * (i % 3 + 1), "rejected": "no"} for i in range(10)],
                         tokenizer, [f"p:{i}" for i in range(10)])
    padded = pair_rows(pairs, 8, 1)
    rows = packed_pair_rows(pairs, 24, 1)
    assert rows.pairs == 10 and rows.supervised.sum() == 10 and rows.pair_index.shape[1] >= 2
    for row in range(len(rows)):
        for k, i in enumerate(rows.pair_index[row]):
            if i < 0:
                assert not (rows.slots[row] >= 2 * k).any()  # an empty slot holds no token
                continue
            for j in (0, 1):  # each reply: its padded row's tokens, labels (but the first) and positions 0..n-1
                where = rows.slots[row] == 2 * k + j
                n = int(padded.attention_mask[i, j].sum())
                assert where.sum() == n and np.array_equal(rows.input_ids[row][where], padded.input_ids[i, j, :n])
                assert np.array_equal(rows.labels[row][where][1:], padded.labels[i, j, 1:n])
                assert rows.labels[row][where][0] == IGNORE and np.array_equal(rows.position_ids[row][where],
                                                                                np.arange(n))
    batch = PairBatches(rows, 2, 1, 0, 1, seed=0, reference=np.arange(20, dtype=np.float64).reshape(10, 2))[(0, 0)]
    index = batch["pair_index"]
    assert batch["sum_per_document"].shape == (2, 24, 2 * index.shape[1])
    assert batch["num_items_in_step"].tolist() == [int((index >= 0).sum())] * 2
    want = torch.stack([index * 2, index * 2 + 1], -1).to(torch.float64).where(index[..., None] >= 0, 0.0)
    assert torch.equal(batch["reference_logps"], want.reshape(2, -1))
    # IPO's per-reply token counts: each slot's, equal to its padded row's (empty slots 0)
    tokens = document_tokens(batch["labels"], batch["sum_per_document"])
    want_tokens = torch.stack([torch.from_numpy(padded.reply_tokens[index.clamp_min(0).numpy()][..., j])
                               for j in (0, 1)], -1).where(index[..., None] >= 0, 0)
    assert torch.equal(tokens, want_tokens.reshape(2, -1))
    with pytest.raises(ValueError, match=r"p:2: its two replies take 8 tokens, more than the block of 7"):
        packed_pair_rows(pairs, 7, 1, names=[f"p:{i}" for i in range(10)])
    cut = packed_pair_rows(pairs, 7, 1, "truncate")  # the 8-token pairs keep 3 tokens of each reply
    assert (cut.slots >= 0).sum(1).max() <= 7 and cut.pairs == 10 and (cut.slots == 0).sum(1).min() == 3


def _per_row_reference(logits, labels):
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    logp = logits.log_softmax(-1).gather(-1, shifted.clamp_min(0)[..., None])[..., 0]
    return -(logp * (shifted != -100)).sum(-1)


def test_per_row_sums_from_whole_and_from_sharded_chunked_logits_equal_one_process():
    torch.manual_seed(0)
    b, s, h, v = 3, 10, 8, 13
    x, head = torch.randn(b, s, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s))
    labels[:, :4] = -100
    labels[1, 7:] = -100
    want = _per_row_reference(x @ head.T, labels)
    loss = CausalLMLoss(lambda *a, **k: pytest.fail("the original loss is not per row"))
    got = loss(x @ head.T, labels, v, sum_per_row=True)
    assert got.shape == (b,) and torch.allclose(got, want, rtol=1e-13)

    def on_rank(group):  # rank r holds vocabulary rows [r·7, r·7 + 7) of the padded 14; chunks of 3 positions
        rows = torch.cat([head, torch.zeros(1, h, dtype=torch.float64)])[group.rank * 7:(group.rank + 1) * 7]
        logits = VocabShardedLogits.pending(lambda a: a @ rows.T, x, group, v, chunk=3)
        return loss(logits, labels, v, sum_per_row=True)

    for sharded in run_emulated(2, on_rank):
        assert sharded.shape == (b,) and torch.allclose(sharded, want, rtol=1e-13)


def test_per_document_sums_of_packed_rows_equal_each_document_s_own_row():
    """Two documents a row (positions 0–4 and 5–9, the second's first label ignored as packing makes it): each
    document's sum equals its tokens' share of the row, from whole and from sharded chunked logits."""
    torch.manual_seed(0)
    b, s, h, v = 2, 10, 8, 13
    x, head = torch.randn(b, s, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s))
    labels[:, [0, 1, 5, 6]] = -100
    documents = torch.zeros(b, s, 3, dtype=torch.bool)  # a third, empty slot
    documents[:, :5, 0], documents[:, 5:, 1] = True, True
    logits = x @ head.T
    want = torch.stack([_per_row_reference(logits[:, :5], labels[:, :5]),
                        _per_row_reference(logits[:, 5:], labels[:, 5:]), torch.zeros(b, dtype=torch.float64)], -1)
    loss = CausalLMLoss(lambda *a, **k: pytest.fail("the original loss is not per document"))
    got = loss(logits, labels, v, sum_per_document=documents)
    assert got.shape == (b, 3) and torch.allclose(got, want, rtol=1e-13) and torch.equal(got[:, 2], want[:, 2])

    def on_rank(group):
        rows = torch.cat([head, torch.zeros(1, h, dtype=torch.float64)])[group.rank * 7:(group.rank + 1) * 7]
        sharded = VocabShardedLogits.pending(lambda a: a @ rows.T, x, group, v, chunk=3)
        return loss(sharded, labels, v, sum_per_document=documents)

    for sharded in run_emulated(2, on_rank):
        assert sharded.shape == (b, 3) and torch.allclose(sharded, want, rtol=1e-13)


def test_the_reference_cache_reads_back_bit_for_bit_and_refuses_damage_and_other_runs(tmp_path):
    values = {"training": np.random.default_rng(0).normal(size=(5, 2)) * 10, "validation": np.array([[-1 / 3, -2.0]])}
    identity = {"model": [{"path": "/m/config.json", "bytes": 10, "mtime_ns": 1}], "block_size": 32}
    path = tmp_path / "ref.json"
    write_reference(path, values, identity)
    back = read_reference(path, identity)
    assert all(np.array_equal(back[k], values[k]) for k in values)  # float64 written by repr: exact
    with pytest.raises(ValueError, match="computed for another block_size than this run's"):
        read_reference(path, {**identity, "block_size": 64})
    body = json.loads(path.read_text())
    body["values"]["training"][2][1] += 1e-12
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="is damaged: its values do not match their SHA-256"):
        read_reference(path, identity)
    path.write_text(path.read_text()[:-20])
    with pytest.raises(ValueError, match="is not a DPO reference cache, or is damaged"):
        read_reference(path, identity)


def test_the_run_reads_its_cache_recomputes_a_damaged_default_and_refuses_a_foreign_one(tmp_path, tokenizer,
                                                                                          monkeypatch):
    from lightning_seqpar.models import dpo_reference
    from tests.helpers.chat_tokenizer import make_chat_model_dir

    model = make_chat_model_dir(tmp_path / "model")
    data = PreferenceDataModule(str(write_preferences(tmp_path / "pairs.jsonl", 10)), tokenizer, 32, 2)
    computed = {"training": np.full((9, 2), -3.0), "validation": np.full((1, 2), -4.0)}
    calls = []
    monkeypatch.setattr(dpo_reference, "compute_reference_logps", lambda *a: calls.append(a) or computed)
    trainer = SimpleNamespace(strategy=SimpleNamespace(pp=1), global_rank=0)
    full, lora = SimpleNamespace(lora=None, pretrained=str(model)), SimpleNamespace(lora={"r": 4}, pretrained=str(model))
    assert dpo_reference.reference_for_run(trainer, lora, data) is None and calls == []  # the base, in the step
    pipelined = SimpleNamespace(strategy=SimpleNamespace(pp=2), global_rank=0)  # its own schedule (reference_step)
    assert dpo_reference.reference_for_run(pipelined, lora, data) is None and calls == []
    first = dpo_reference.reference_for_run(trainer, full, data)
    cache = next((tmp_path / "pairs.jsonl.dpo-reference").glob("*.json"))
    assert first is computed and len(calls) == 1
    again = dpo_reference.reference_for_run(trainer, full, data)  # read back: nothing computed
    assert len(calls) == 1 and all(np.array_equal(again[k], computed[k]) for k in computed)
    cache.write_text(cache.read_text().replace("-3.0", "-3.5", 1))
    dpo_reference.reference_for_run(trainer, full, data)  # damaged at its default place: computed again
    assert len(calls) == 2 and dpo_reference.read_reference(cache, None)["training"][0, 0] == -3.0
    data.block_size = 64  # another identity, given explicitly: refused by name
    with pytest.raises(ValueError, match="computed for another block_size than this run's"):
        dpo_reference.reference_for_run(trainer, full, data, str(cache))
    assert len(calls) == 2


@pytest.mark.parametrize("has_adapters, pipelined, why", [
    (False, False, "full fine-tuning has no frozen copy.*data.reference = lightning_seqpar.models.dpo_reference"),
    (True, True, "each micro-batch runs one forward.*from the module's reference_step")])
def test_no_reference_in_the_batch_is_refused_where_the_step_cannot_compute_it(has_adapters, pipelined, why):
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=why):
        PreferenceLoss(0.1, "sigmoid", has_adapters).reference_logps(torch.nn.Identity(), batch, pipelined)


@pytest.mark.parametrize("loss, first", [("sigmoid", math.log(2)), ("ipo", (1 / (2 * 0.25)) ** 2)])
def test_a_users_script_on_one_device_trains_lora_dpo_from_the_base(tmp_path, tokenizer, loss, first):
    """FineTuneModule(objective="dpo") under Lightning's own single-device strategy: at the first step (B = 0) the
    policy is the reference, so every pair's loss is ln 2 (sigmoid) or (1/(2β))² (IPO); then it learns the rule."""
    import lightning.pytorch as pl

    from lightning_seqpar.models.finetune import FineTuneModule
    from tests.helpers.chat_tokenizer import make_chat_model_dir

    model = make_chat_model_dir(tmp_path / "model")
    data = PreferenceDataModule(str(write_preferences(tmp_path / "pairs.jsonl", 24)), tokenizer, 32, 4,
                                val_fraction=0.2)
    module = FineTuneModule(str(model), {"r": 4, "alpha": 8}, objective="dpo", dpo_beta=0.25, dpo_loss=loss,
                            learning_rate=5e-2, warmup_steps=0)
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(trainer.callback_metrics["train/loss"].item())

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Losses()])
    trainer.fit(module, datamodule=data)
    assert losses[0] == pytest.approx(first, rel=1e-6) and losses[-1] < 0.95 * losses[0]


def test_a_model_whose_forward_takes_no_keyword_arguments_is_refused_by_name():
    class Closed(torch.nn.Module):
        def forward(self, input_ids, labels=None, attention_mask=None):
            return SimpleNamespace(loss=torch.zeros(()))

    class Scalar(Closed):
        def forward(self, input_ids, labels=None, attention_mask=None, **kwargs):
            return SimpleNamespace(loss=torch.zeros(()))  # drops sum_per_row: one number, not one per row

    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": torch.zeros(4, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="Closed's forward takes no keyword arguments beyond its own"):
        PreferenceLoss(0.1, "sigmoid", True).row_logps(Closed(), batch)
    with pytest.raises(ValueError, match=r"Scalar returned a loss of shape \(\) for sum_per_row=True, not one per row"):
        PreferenceLoss(0.1, "sigmoid", True).row_logps(Scalar(), batch)


def test_the_reference_pass_covers_every_pair_whatever_the_runs_limit_val_batches():
    """A run with trainer.limit_val_batches=1 validates one batch; its reference pass must still compute every pair
    (was: "its loader did not cover the split"), and the run's own limit is back afterwards."""
    from lightning_seqpar.models.dpo_reference import compute_reference_logps

    pairs = {"training": 5, "validation": 3}
    data = SimpleNamespace(reference_split=None, train_rows=SimpleNamespace(pairs=5), val_rows=SimpleNamespace(pairs=3))
    module = SimpleNamespace(reference_collector=None)

    def validate(module, datamodule, verbose):  # the batches a validation runs: as many as the limit allows
        covered = pairs[datamodule.reference_split] if trainer.limit_val_batches == 1.0 else 1
        for i in range(covered):
            module.reference_collector.values[i] = (-float(i), -2.0 * i)

    trainer = SimpleNamespace(limit_val_batches=1, validate=validate)
    values = compute_reference_logps(trainer, module, data)
    assert values["training"].shape == (5, 2) and values["validation"][2].tolist() == [-2.0, -4.0]
    assert trainer.limit_val_batches == 1 and module.reference_collector is None


def test_default_reference_caches_live_in_one_folder_and_only_the_newest_are_kept(tmp_path):
    import os

    from lightning_seqpar.models.dpo_reference import KEPT_REFERENCES, default_reference_path, prune_references

    data = SimpleNamespace(path=tmp_path / "pairs.jsonl")
    folder = default_reference_path(data, {"model": "a"}).parent
    assert folder == tmp_path / "pairs.jsonl.dpo-reference"
    assert default_reference_path(data, {"model": "b"}) != default_reference_path(data, {"model": "a"})
    folder.mkdir()
    written = []
    for i in range(KEPT_REFERENCES + 2):
        path = default_reference_path(data, {"model": str(i)})
        path.write_text("{}")
        os.utime(path, ns=(i * 10**9, i * 10**9))  # written one after another
        written.append(path)
    legacy = tmp_path / "pairs.jsonl.dpo-reference-0123456789abcdef.json"  # where earlier releases wrote them
    legacy.write_text("{}")
    unrelated = tmp_path / "pairs.jsonl"
    unrelated.write_text("data")
    gone = prune_references(folder)
    assert sorted(gone) == sorted(written[:2] + [legacy])
    assert sorted(folder.iterdir()) == sorted(written[2:]) and unrelated.exists()
