"""Every artefact reused between runs names its inputs by content: an input rewritten with other bytes of the same size,
its modification time put back, is another input (the token cache, the supervised cache, the DPO reference cache)."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from lightning_seqpar.checkpoint.content import content_digest
from lightning_seqpar.data import TextDataModule, ensure_token_cache
from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule
from lightning_seqpar.data.token_file import open_tokens
from lightning_seqpar.models.dpo_reference import reference_identity
from tests.data.test_supervised_data import CONVERSATIONS, _tok


def _rewrite_keeping_size_and_time(path: Path, text: str) -> None:
    before = path.stat()
    assert len(text.encode()) == before.st_size
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the old time put back
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def test_a_file_rewritten_with_its_size_and_time_has_another_digest(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abcd")
    first = content_digest(path)
    assert content_digest(path) == first  # once per process while unchanged
    _rewrite_keeping_size_and_time(path, "abce")
    assert content_digest(path) != first


def test_the_token_cache_is_made_again_for_a_corpus_rewritten_with_its_size_and_time(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 20)
    tokenizer = TextDataModule(str(corpus)).tokenizer
    _, before = open_tokens(ensure_token_cache(corpus, tokenizer, progress=False))
    _rewrite_keeping_size_and_time(corpus, "HELLO WORLD " * 20)
    _, after = open_tokens(ensure_token_cache(corpus, tokenizer, progress=False))
    text = lambda ids: bytes(np.asarray(ids, dtype=np.uint8))  # noqa: E731 - byte ids back to the corpus
    assert text(before).startswith(b"hello world") and text(after).startswith(b"HELLO WORLD")


def test_the_supervised_cache_is_prepared_again_for_data_rewritten_with_its_size_and_time(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    module = FineTuneDataModule(str(data), _tok(), block_size=32, batch_size=1, val_fraction=0.25)
    cache = module.prepare_cache()
    assert module._matches(cache)
    _rewrite_keeping_size_and_time(data, data.read_text().replace("a", "b"))
    assert not module._matches(cache)  # the cache of the old bytes is not this data's


def test_the_dpo_reference_identity_changes_when_pairs_or_weights_are_rewritten_with_their_size_and_time(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "yes", "rejected": "no!"}) + "\n")
    data = SimpleNamespace(path=pairs, tokenizer=SimpleNamespace(identity="bytes-utf8"), block_size=8,
                           overflow="refuse", val_fraction=0.1)
    first = reference_identity(str(model), data)
    # chosen and rejected swapped: the same size, the old time put back (the stale cache gave a first loss of 25)
    _rewrite_keeping_size_and_time(pairs, json.dumps({"prompt": "p", "chosen": "no!", "rejected": "yes"}) + "\n")
    swapped = reference_identity(str(model), data)
    assert swapped["data"] != first["data"] and swapped["model"] == first["model"]
    before = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(b"\x01" * 64)  # other weights of the same size and time
    os.utime(model / "model.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert reference_identity(str(model), data)["model"] != swapped["model"]
