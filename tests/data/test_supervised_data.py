"""Fine-tuning data on one process: conversations rendered with the tokenizer's chat template and supervised on the
assistant's tokens (against transformers' own rendering and its {% generation %} mask), prompt/completion pairs and
texts, packing with position ids restarting per example, padding, overflow, the cache that records the template,
and micro-batches that carry their optimizer step's supervised-token count."""

import json

import numpy as np
import pytest
import torch

from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule
from lightning_seqpar.data.packing import IGNORE, Rows, pack_examples
from lightning_seqpar.data.step_batches import StepBatches
from lightning_seqpar.data.supervised import render_record
from lightning_seqpar.hf.tokenizer import HFTokenizer
from tests.helpers.chat_tokenizer import CONVERSATIONS, MARKED, chat_tokenizer


def _tok(template=MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")):
    return HFTokenizer(chat_tokenizer(template), "chat")


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_conversations_render_as_transformers_does_and_supervise_the_assistants_tokens(messages):
    plain, marked = _tok(), _tok(MARKED)
    got = render_record({"messages": messages}, plain, "here")  # no markers: the prefixes say where turns are
    reference = marked.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
    assert got.ids.tolist() == list(reference["input_ids"])
    assert got.supervised.tolist() == [bool(m) for m in reference["assistant_masks"]]
    assert got.supervised.any() and not got.supervised.all()
    from_markers = render_record({"messages": messages}, marked, "here")  # with markers: transformers' own mask
    assert from_markers.supervised.tolist() == got.supervised.tolist()
    text = plain.tokenizer.decode(got.ids[got.supervised].tolist())
    assert text.replace(" ", "").replace("<|end|>", "") == "".join(
        m["content"] for m in messages if m["role"] == "assistant").replace(" ", "")


def test_a_conversation_without_a_chat_template_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"data.jsonl:3: .*has no chat template.*\{\"prompt\", \"completion\"\}"):
        render_record({"messages": CONVERSATIONS[1]}, _tok(None), "data.jsonl:3")
    with pytest.raises(ValueError, match="no assistant turn"):
        render_record({"messages": CONVERSATIONS[1][:1]}, _tok(), "here")
    with pytest.raises(ValueError, match=r"expected \"messages\""):
        render_record({"question": "why"}, _tok(), "here")


def test_prompt_completion_and_text_records():
    tok = _tok()
    pair = render_record({"prompt": "what is two plus two", "completion": "four"}, tok, "here")
    assert pair.ids.tolist()[-2:] == [tok.tokenizer.convert_tokens_to_ids("four"), tok.separator[0]]
    assert pair.supervised.tolist() == [False] * 5 + [True, True]  # the completion and the end-of-text token
    text = render_record({"text": "hello how are you"}, tok, "here")
    assert text.supervised.all() and len(text) == 5


def test_packed_rows_restart_positions_and_never_predict_across_an_example():
    tok = _tok()
    examples = [render_record({"prompt": "hello", "completion": w}, tok, "here") for w in ("yes", "no", "ok")]
    rows = pack_examples(examples, 8, pad_id=1)  # 3 tokens each ("hello", the completion, end): two per row
    assert len(rows) == 2 and rows.packed
    assert rows.second[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # the tail after two examples: a padding document
    assert rows.second[1].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert rows.labels[0].tolist() == [IGNORE, *examples[0].ids[1:].tolist(), IGNORE, *examples[1].ids[1:].tolist(),
                                       IGNORE, IGNORE]  # each example's first label: never predicted across
    assert rows.input_ids[1, 3:].tolist() == [1] * 5 and rows.labels[1, 3:].tolist() == [IGNORE] * 5
    assert rows.supervised.tolist() == [4, 2]
    padded = pack_examples(examples, 6, pad_id=1, packing=False)
    assert len(padded) == 3 and padded.second[0].tolist() == [1, 1, 1, 0, 0, 0]  # attention_mask


def test_an_example_longer_than_the_block_is_refused_or_truncated():
    tok = _tok()
    long = render_record({"text": "hello how are you i am fine"}, tok, "here")  # 8 tokens
    with pytest.raises(ValueError, match=r"data.jsonl: record 1: 8 tokens, longer than the block of 6.*"
                                         r"data.overflow=truncate"):
        pack_examples([long], 6, 1, names=["data.jsonl: record 1"])
    assert pack_examples([long], 6, 1, overflow="truncate").input_ids[0].tolist() == long.ids[:6].tolist()


def test_each_micro_batch_carries_its_steps_supervised_token_count():
    n, s = 20, 6
    rng = np.random.default_rng(0)
    labels = np.where(rng.random((n, s)) < 0.4, 7, IGNORE)  # supervised tokens spread unevenly over the rows
    rows = Rows(np.arange(n)[:, None].repeat(s, 1), labels, np.tile(np.arange(s), (n, 1)), True)  # row i holds i
    d, a, b = 2, 2, 2
    ranks = [StepBatches(rows, b, d, r, a, seed=3) for r in range(d)]
    for k in range(len(ranks[0])):
        step = k // a
        batches = [ranks[r][(1, step * a + m)] for r in range(d) for m in range(a)]
        counts = {int(x["num_items_in_step"][0]) for x in batches}
        total = sum(int((x["labels"][:, 1:] != IGNORE).sum()) for x in batches)
        assert counts == {total}  # every rank's every micro-batch of the step knows the step's count
        # The losses R = d·a micro-batches average into the step: each sum over N / R gives one process's mean.
        token_losses = [torch.rand(x["labels"].shape, generator=torch.Generator().manual_seed(i))
                        for i, x in enumerate(batches)]
        sums = [(t[:, 1:] * (x["labels"][:, 1:] != IGNORE)).sum() for t, x in zip(token_losses, batches)]
        averaged = torch.stack([s / (total / (d * a)) for s in sums]).mean()
        torch.testing.assert_close(averaged, torch.stack(sums).sum() / total)
    seen = [tuple(ranks[r][(0, k)]["input_ids"][i].tolist()) for r in range(d) for k in range(len(ranks[r]))
            for i in range(b)]
    assert len(set(seen)) == len(seen)  # no row twice in an epoch
    assert ranks[0][(0, 0)]["input_ids"].tolist() != ranks[0][(1, 0)]["input_ids"].tolist()  # reshuffled per epoch


def test_the_data_module_caches_the_rendering_keyed_by_tokenizer_and_template(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    module = FineTuneDataModule(str(data), _tok(), block_size=32, batch_size=1, val_fraction=0.25)
    module.setup()
    cache = module.cache_path()
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["examples"] == 12 and meta["chat_template"] and meta["supervised"] > 0
    other = FineTuneDataModule(str(data), _tok(MARKED), block_size=32, batch_size=1, val_fraction=0.25)
    assert other.cache_path() != cache  # another template: another cache
    batch = next(iter(module.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "num_items_in_step"}
    assert int(batch["num_items_in_step"][0]) == int((batch["labels"][:, 1:] != IGNORE).sum())  # d = a = 1
    val = next(iter(module.val_dataloader()))
    assert int(val["num_items_in_step"][0]) == int((val["labels"][:, 1:] != IGNORE).sum())  # its own step's count


def test_a_validation_loader_counts_the_tokens_of_the_batches_that_run():
    rows = pack_examples([render_record({"prompt": "hello", "completion": " ".join(["yes"] * n)}, _tok(), "here")
                          for n in range(1, 9)], 16, 0, packing=False)
    ranks = [StepBatches(rows, 1, 2, q, 1, seed=0, shuffle=False, split="validation") for q in range(2)]
    counts = [int((ranks[q][(0, k)]["labels"][:, 1:] != IGNORE).sum()) for k in range(4) for q in range(2)]
    assert ranks[0].supervised_in(1) == sum(counts[:2]) < ranks[0].supervised_in(3) == sum(counts[:6])
    assert ranks[1].supervised_in(float("inf")) == ranks[0].supervised_in(4) == sum(counts) == rows.supervised.sum()


def test_a_split_with_no_supervised_token_is_refused_naming_the_file(tmp_path):
    """A template that ends an assistant turn with nothing of its own: empty replies supervise no token, and a mean
    over none would report loss 0 and perplexity 1."""
    bare = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    data = tmp_path / "empty.jsonl"
    empty = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]] * 8
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in empty))
    module = FineTuneDataModule(str(data), _tok(bare), block_size=32, batch_size=1, val_fraction=0.25)
    with pytest.raises(ValueError, match=r"empty\.jsonl: the training split \(records 1-6\) has no supervised token"):
        module.setup()



def _chat_file(tmp_path, n=12):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CONVERSATIONS * n)[:n]))
    return data


def test_a_damaged_cache_is_prepared_again_with_a_warning_and_refused_by_name_when_given_directly(tmp_path, caplog):
    data = _chat_file(tmp_path)
    first = FineTuneDataModule(str(data), _tok(), block_size=32, batch_size=1, val_fraction=0.25, progress=False)
    first.setup()
    rows = first.train_rows.materialize()  # rows are read from the cache when asked: these, before the damage
    cache = first.cache_path()
    ids = cache / "ids.bin"
    damaged = bytearray(ids.read_bytes())
    damaged[5] ^= 0x01
    ids.write_bytes(bytes(damaged))
    given = FineTuneDataModule(str(cache), _tok(), block_size=32, batch_size=1, val_fraction=0.25)
    with pytest.raises(ValueError, match=r"The fine-tuning cache .*sft-.* is damaged: ids.bin does not match its "
                                         r"recorded SHA-256. Prepare it again from its .jsonl file."):
        given.setup()
    again = FineTuneDataModule(str(data), _tok(), block_size=32, batch_size=1, val_fraction=0.25, progress=False)
    with caplog.at_level("WARNING"):
        again.setup()
    assert "is damaged (ids.bin does not match its recorded SHA-256): prepared again from" in caplog.text
    assert np.array_equal(again.train_rows.input_ids, rows.input_ids)
    whole = FineTuneDataModule(str(cache), _tok(), block_size=32, batch_size=1, val_fraction=0.25)
    whole.setup()  # the rebuilt cache, given directly, is read as it is
    assert np.array_equal(whole.train_rows.labels, rows.labels)
    (cache / "lengths.bin").write_bytes(b"")  # truncated: another size than recorded
    with pytest.raises(ValueError, match=r"lengths.bin is missing or of another size than recorded"):
        FineTuneDataModule(str(cache), _tok(), block_size=32, batch_size=1).setup()


@pytest.mark.parametrize("line, message", [
    (b'{"messages": [{"role": "user", "content": "hi"}', r"bad.jsonl:7: not JSON \(Expecting ',' delimiter at column "
                                                         r"48\); each line must be one JSON object."),
    (b'{"messages": "hello"}', r"bad.jsonl:7: \"messages\" is str 'hello'; expected a list of"),
    (b'{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}',
     r"bad.jsonl:7: message 0 is .*; each message needs a \"role\" and a \"content\"."),
    (b'{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
     r"bad.jsonl:7: message 0's content is int '3'; expected a string"),
    (b'{"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]}',
     r"bad.jsonl:7: message 0's content is list"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}',
     r"bad.jsonl:7: message 1 has role 'robot', which the chat template does not know; the roles are system, user, "
     r"assistant, tool. Rename it"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
     r"bad.jsonl:7: message 1 has role 'bot'"),
    (b'{"text": "caf\xe9 ok"}', r"bad.jsonl:7: byte 14 of the line is not UTF-8 \(b'\\xe9'\); save the file as UTF-8."),
    (b'{"prompt": "hi", "completion": 4}', r"bad.jsonl:7: \"completion\" is int '4'; expected a string."),
])
def test_a_bad_record_is_refused_naming_the_file_and_line_and_the_fix(tmp_path, line, message):
    good = [json.dumps({"messages": CONVERSATIONS[i % 3]}).encode() for i in range(6)]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join(good + [line] + good) + b"\n")
    module = FineTuneDataModule(str(data), _tok(), block_size=32, batch_size=1, progress=False)
    with pytest.raises(ValueError, match=message):
        module.setup()
    assert not list(tmp_path.glob("*.sft-*")) and not list(tmp_path.glob(".*tmp*"))  # nothing half-written is left


def test_batched_rendering_equals_one_record_at_a_time(tmp_path):
    from lightning_seqpar.data.supervised import render_records

    records = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": "hello", "completion": "yes"}, {"text": "sun moon"}]
    for tokenizer in (_tok(), _tok(MARKED)):
        batched = render_records(records, tokenizer, [f"r{i}" for i in range(len(records))])
        for record, example in zip(records, batched):
            alone = render_record(record, tokenizer, "here")
            assert example.ids.tolist() == alone.ids.tolist()
            assert example.supervised.tolist() == alone.supervised.tolist()


def _step_rows(layout, rows, epoch, steps, state=None):
    """The rows of each of ``steps`` optimizer steps under ``layout = (d, a, b)``, every rank's every micro-batch,
    through the samplers the loaders use (restored from ``state`` when given); and rank 0's sampler state after."""
    d, a, b = layout
    ranks = [StepBatches(rows, b, d, q, a, seed=3) for q in range(d)]
    samplers = [r.sampler() for r in ranks]
    for sampler in samplers:
        sampler.set_epoch(epoch)
        if state is not None:
            sampler.load_state_dict(state)
    iterators = [iter(s) for s in samplers]
    out = []
    for _ in range(steps):
        out.append(sorted(int(i) for q in range(d) for _ in range(a)
                          for i in ranks[q][next(iterators[q])]["input_ids"][:, 0]))
    return out, samplers[0].state_dict()


@pytest.mark.parametrize("saved, resumed", [((2, 1, 2), (1, 1, 4)), ((1, 2, 2), (2, 1, 2)), ((2, 2, 1), (4, 1, 1))])
def test_a_fine_tuning_position_resumes_at_another_data_parallel_size_and_accumulation_on_the_same_rows(saved, resumed):
    n, s = 40, 4
    rows = Rows(np.arange(n)[:, None].repeat(s, 1), np.full((n, s), 7), np.tile(np.arange(s), (n, 1)), True)
    straight, _ = _step_rows((1, 1, 4), rows, 1, 6)
    first, state = _step_rows(saved, rows, 1, 3)
    assert first == straight[:3] and state["global_row"] == 12 and state["epoch"] == 1
    after, _ = _step_rows(resumed, rows, 1, 3, state)
    assert after == straight[3:]
    # Lightning counting another epoch (a checkpoint at a max_steps end): the saved epoch's order still continues.
    assert _step_rows(resumed, rows, 2, 3, state)[0] == straight[3:]


def test_a_fine_tuning_resume_under_another_global_batch_says_so(caplog):
    n, s = 40, 4
    rows = Rows(np.arange(n)[:, None].repeat(s, 1), np.full((n, s), 7), np.tile(np.arange(s), (n, 1)), True)
    _, state = _step_rows((2, 1, 2), rows, 0, 2)
    with caplog.at_level("WARNING", logger="lightning_seqpar.data.step_batches"):
        after, _ = _step_rows((2, 1, 4), rows, 0, 1, state)
    assert "continuing at global row 8 of epoch 0 with a global batch of 8 rows" in caplog.text
    assert after == [sorted(int(i) for i in StepBatches(rows, 1, 1, 0, 1, seed=3)._order(0)[8:16])]
