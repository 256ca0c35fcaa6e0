"""The token cache: written once in the narrowest dtype, reused, rebuilt or refused when it belongs to another
tokenizer or corpus, never misread; and the checks a corpus passes before training."""

import json
import logging

import numpy as np
import pytest
import torch

from lightning_seqpar.data import TextDataModule, ensure_token_cache
from lightning_seqpar.data.cache import cache_path, wait_for_token_cache
from lightning_seqpar.data.token_file import open_tokens, read_header


class WordTokenizer:
    """Each whitespace-separated word is one id: ``base + its index`` in ``words``; the separator is id 0."""

    def __init__(self, words, base=65_530, name="words", salt=""):
        self.ids = {w: base + i for i, w in enumerate(words)}
        self.words = {i: w for w, i in self.ids.items()}
        self.name, self.identity = name, f"words-{base}-{len(words)}{salt}"
        self.vocab_size, self.separator = base + len(words), [0]

    def encode_batch(self, texts):
        return [np.array([self.ids[w] for w in t.split()], dtype=np.int64) for t in texts]

    def decode(self, ids):
        return " ".join(self.words.get(int(i), "?") for i in ids)


WORDS = [f"w{i}" for i in range(40)]


def _corpus(tmp_path, lines=200):
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(WORDS[j] for j in rng.integers(0, 40, 10)) for _ in range(lines)) + "\n"
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path, text


def test_a_vocabulary_above_65536_is_stored_as_uint32_and_read_back_exactly(tmp_path):
    path, text = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS)  # ids 65530 .. 65569
    cache = ensure_token_cache(path, tokenizer, progress=False)
    header, ids = open_tokens(cache)
    expected = [tokenizer.ids[w] for w in text.split()] + [0]  # one document: the separator after it
    assert header.dtype == "uint32" and header.max_id == max(expected) > 65535
    assert ids.tolist() == expected
    data = TextDataModule(str(path), tokenizer=tokenizer, block_size=8, val_fraction=0.1)
    data.setup()
    x, y = data.train_set[3]
    assert x.dtype == torch.int64 and x.tolist() == expected[24:32] and y.tolist() == expected[25:33]
    assert data.vocab_size == 65570 and data.decode(x).split() == text.split()[24:32]


def test_bytes_are_stored_one_byte_each(tmp_path):
    path, text = _corpus(tmp_path)
    header, ids = open_tokens(ensure_token_cache(path, TextDataModule(str(path)).tokenizer, progress=False))
    assert header.dtype == "uint8" and bytes(ids.tolist()) == text.encode() + b"\n\n"


def test_the_cache_is_reused_unless_the_tokenizer_or_the_files_change(tmp_path, caplog):
    path, _ = _corpus(tmp_path)
    cache = ensure_token_cache(path, WordTokenizer(WORDS), progress=False)
    written = cache.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="lightning_seqpar.data.cache"):
        assert ensure_token_cache(path, WordTokenizer(WORDS), progress=False) == cache
        assert cache.stat().st_mtime_ns == written and "up to date: reusing it" in caplog.text
        caplog.clear()
        other = WordTokenizer(WORDS, base=100, salt="-retrained")  # same name, other ids
        ensure_token_cache(path, other, progress=False)
        assert "made with another tokenizer" in caplog.text and read_header(cache).max_id < 200
        caplog.clear()
        path.write_text(path.read_text() + "w1 w2\n")
        ensure_token_cache(path, other, progress=False)
        assert "corpus files changed" in caplog.text and open_tokens(cache)[1].tolist()[-3:] == [101, 102, 0]


def test_a_damaged_cache_is_rebuilt_and_a_foreign_one_is_refused(tmp_path):
    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS)
    cache = ensure_token_cache(path, tokenizer, progress=False)
    size = cache.stat().st_size
    with open(cache, "r+b") as file:
        file.truncate(size - 4)
    with pytest.raises(ValueError, match="damaged or truncated"):
        open_tokens(cache)
    ensure_token_cache(path, tokenizer, progress=False)
    assert cache.stat().st_size == size
    with pytest.raises(ValueError, match="was tokenized by words .*not by other .*its ids mean other tokens"):
        TextDataModule(str(cache), tokenizer=WordTokenizer(WORDS, base=7, name="other"))
    assert TextDataModule(str(cache), tokenizer=tokenizer).vocab_size == 65570


def _edit_body(cache, offset, data):
    from lightning_seqpar.data.token_file import DATA_OFFSET

    with open(cache, "r+b") as file:
        file.seek(DATA_OFFSET + offset)
        file.write(data)


@pytest.mark.parametrize("damage", [b"\xff\xff", b"\0" * 64])  # flipped bytes (id 65535), a zeroed run of bytes
def test_a_cache_whose_ids_were_damaged_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS, base=100)  # uint8 ids below 256: 0xff is out of its vocabulary of 140
    cache = ensure_token_cache(path, tokenizer, progress=False)
    before = open_tokens(cache)[1].tolist()
    _edit_body(cache, 10, damage)
    with caplog.at_level(logging.WARNING, logger="lightning_seqpar.data.cache"):
        ensure_token_cache(path, tokenizer, progress=False)
    assert "is rebuilt: its ids are damaged: bytes 4096.." in caplog.text
    assert open_tokens(cache)[1].tolist() == before


def test_a_damaged_tokens_file_given_directly_is_refused_naming_the_bytes(tmp_path):
    path, _ = _corpus(tmp_path)
    cache = ensure_token_cache(path, WordTokenizer(WORDS, base=100), progress=False)
    _edit_body(cache, 3, b"\xff")
    with pytest.raises(ValueError, match=rf"{cache}: bytes 4096\.\.\d+ differ from what was written\. Given as a "
                                         rf"\.tokens file, it cannot be rebuilt here"):
        TextDataModule(str(cache))


def test_a_cache_written_before_bodies_were_checked_is_rebuilt(tmp_path, caplog):
    import json as json_module

    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS)
    cache = ensure_token_cache(path, tokenizer, progress=False)
    header = read_header(cache)
    header.block_bytes, header.block_crc32 = 0, []
    with open(cache, "r+b") as file:
        file.write(header.to_bytes())
    assert json_module.loads(read_header(cache).to_bytes()[16:])["block_bytes"] == 0
    with caplog.at_level(logging.WARNING, logger="lightning_seqpar.data.cache"):
        ensure_token_cache(path, tokenizer, progress=False)
    assert "records no checksum of its ids" in caplog.text and read_header(cache).block_bytes > 0


def test_json_lines_documents_are_joined_by_the_end_of_text_token(tmp_path):
    records = [{"text": "w1 w2", "id": 1}, {"text": "w3", "id": 2}, {"body": "w4"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n")
    tokenizer = WordTokenizer(WORDS, base=10)
    header, ids = open_tokens(ensure_token_cache(tmp_path / "c.jsonl", tokenizer, progress=False))
    assert ids.tolist() == [11, 12, 0, 13, 0] and header.text_field == "text" and header.dtype == "uint8"
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3 has no string field 'text' \(it has \['body'\]\).*data.text_field"):
        ensure_token_cache(tmp_path / "d.jsonl", tokenizer, progress=False)
    assert not cache_path(tmp_path / "d.jsonl", tokenizer).exists()  # nothing half-written is left
    assert list(tmp_path.glob(".d.jsonl*")) == []
    (tmp_path / "e.jsonl").write_text(json.dumps(records[2]) + "\n")
    header, ids = open_tokens(ensure_token_cache(tmp_path / "e.jsonl", tokenizer, text_field="body", progress=False))
    assert ids.tolist() == [14, 0]


def test_ids_the_model_cannot_embed_are_refused_before_training(tmp_path):
    path, _ = _corpus(tmp_path)
    data = TextDataModule(str(path), tokenizer=WordTokenizer(WORDS), block_size=8)
    data.setup()
    data.check_model(65570)
    with pytest.raises(ValueError, match=r"holds token id 65569 \(first at or above it at position \d+\), but the "
                                         r"model's vocabulary has 65536 ids"):
        data.check_model(65536)


def test_a_uint16_token_file_cannot_feed_a_larger_vocabulary(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="holds uint16 ids, which cannot name a vocabulary of 128256 \\(data.vocab_size; uint16 names 65536\\)"):
        TextDataModule(str(tmp_path / "t.bin"), vocab_size=128256)
    data = TextDataModule(str(tmp_path / "t.bin"), block_size=8)
    with pytest.raises(ValueError, match="holds uint16 ids, which cannot name the model's 128256 tokens"):
        data.check_model(128256)
    (tmp_path / "u.bin").write_bytes(np.array([70000, 3, 128000, 5] * 10, dtype=np.uint32).tobytes())
    wide = TextDataModule(str(tmp_path / "u.bin"), token_dtype="uint32", vocab_size=128256, block_size=3,
                           val_fraction=0.25)
    wide.setup()
    assert wide.train_set[0][0].tolist() == [70000, 3, 128000]
    wide.check_model(128256)


def test_byte_text_for_a_model_with_a_tokenizer_is_refused_unless_asked_for(tmp_path):
    path, _ = _corpus(tmp_path)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="read as UTF-8 bytes, but the model has a tokenizer .*data.tokenizer=bytes"):
        TextDataModule(str(path)).check_model(32000, str(model_dir))
    TextDataModule(str(path), tokenizer="bytes").check_model(32000, str(model_dir))


def test_a_vocabulary_size_that_cannot_apply_is_refused(tmp_path):
    path, _ = _corpus(tmp_path)
    with pytest.raises(ValueError, match="data.vocab_size=50257 cannot apply: the vocabulary is 256"):
        TextDataModule(str(path), vocab_size=50257)


def test_prompts_and_samples_are_text_of_the_tokenizer(tmp_path):
    path, _ = _corpus(tmp_path)
    data = TextDataModule(str(path), tokenizer=WordTokenizer(WORDS))
    assert data.prompt("w3 w4").tolist() == [65533, 65534] and data.prompt("").tolist() == [0]
    assert data.decode(torch.tensor([65533, 65534])) == "w3 w4"


def test_other_ranks_wait_for_the_cache_and_give_up_on_a_writer_that_stalls(tmp_path):
    import threading
    import time

    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS)
    writer = threading.Timer(0.5, lambda: ensure_token_cache(path, tokenizer, progress=False))
    writer.start()
    assert wait_for_token_cache(path, tokenizer, stall_timeout=30) == cache_path(path, tokenizer)
    writer.join()
    other = WordTokenizer(WORDS, base=3, salt="-other")  # its cache is stale and nobody rebuilds it
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="neither written nor valid after 1 s without progress"):
        wait_for_token_cache(path, other, stall_timeout=1.0, poll=0.05)
    assert time.monotonic() - started < 5


def test_what_a_killed_tokenization_left_is_removed_by_the_next_one(tmp_path):
    import os
    import subprocess
    import sys

    from lightning_seqpar.checkpoint.atomic import temporary_path, writer_identity

    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(dead.stdout)  # a process that has exited: the writer of a partial cache killed earlier
    partial = temporary_path(cache_path(path, tokenizer), f"{gone}-1")
    partial.write_bytes(b"\0" * 4096)
    alive = temporary_path(cache_path(path, tokenizer), writer_identity(os.getppid()))  # a live writer's: kept
    alive.write_bytes(b"")
    ensure_token_cache(path, tokenizer, progress=False)
    assert not partial.exists() and alive.exists()


def test_a_full_disk_while_tokenizing_names_the_cache_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from lightning_seqpar.data import token_file

    path, _ = _corpus(tmp_path)

    class FullDisk:
        def __init__(self, real):
            self.real, self.writes = real, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 1:  # after the header's placeholder: the disk fills up
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.real.write(data)

        def __getattr__(self, name):
            return getattr(self.real, name)

    real_open = open
    monkeypatch.setattr(token_file, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError, match=r"Writing the token cache .*\.corpus\.txt\.words\.tokens\.tmp-[\d-]+ failed \(No "
                                      r"space left on device\): free space there, or set data.cache_dir"):
        ensure_token_cache(path, WordTokenizer(WORDS), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_a_waiting_rank_reads_a_damaged_cache_once_not_at_every_poll(tmp_path, monkeypatch):
    from lightning_seqpar.data import cache as cache_module

    path, _ = _corpus(tmp_path)
    tokenizer = WordTokenizer(WORDS, base=100)
    cache = ensure_token_cache(path, tokenizer, progress=False)
    _edit_body(cache, 3, b"\xff")  # rank 0 would rebuild it; this rank waits
    reads = []
    real = cache_module.body_damage
    monkeypatch.setattr(cache_module, "body_damage", lambda *a: reads.append(1) or real(*a))
    with pytest.raises(TimeoutError, match="neither written nor valid"):
        wait_for_token_cache(path, tokenizer, stall_timeout=0.5, poll=0.05)
    assert len(reads) == 1  # ten polls, one pass over the ids
