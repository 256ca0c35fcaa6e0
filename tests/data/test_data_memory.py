"""A corpus larger than any rank should hold: tokenized by rank 0 a piece at a time, read by every rank through a
memory map; neither holds the corpus in its own memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_seqpar.data import TextDataModule, ensure_token_cache
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import AnonymousPeak, anonymous_bytes

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

CORPUS_BYTES = 52 * 2**20


def _write_corpus(path, lexicon_text: str) -> None:
    words = sorted(set(lexicon_text.split()))
    rng = random.Random(0)
    with open(path, "w") as file:
        written = 0
        while written < CORPUS_BYTES:
            line = "The " + " ".join(rng.choices(words, k=12)) + ".\n"
            file.write(line)
            written += len(line)


def _tokenize_and_read(rank: int, world_size: int, corpus: str, model_dir: str) -> dict:
    data = TextDataModule(corpus, tokenizer=model_dir, block_size=128, batch_size=16)
    out = {}
    if rank == 0:
        # The Rust tokenizer's working set (its worker threads' buffers) appears with the first batch and is the same
        # for any corpus: measured apart, so what follows is the memory the data itself takes.
        before = anonymous_bytes()
        with open(corpus) as file:
            data.tokenizer.encode_batch([file.read(65536)] * 8)
        out["tokenizer_working_set"] = anonymous_bytes() - before
        with AnonymousPeak() as tokenizing:
            ensure_token_cache(Path(corpus), data.tokenizer, progress=False)
        out["tokenizing"] = tokenizing.growth
    dist.barrier()
    with AnonymousPeak() as reading:
        data.setup("fit")
        batches = sum(1 for _ in data.train_dataloader())  # every training block once, as an epoch does
    out.update(reading=reading.growth, batches=batches, tokens=data.source.open().shape[0])
    return out


def test_tokenizing_and_reading_a_52_mb_corpus_keeps_each_ranks_data_memory_under_a_tenth_of_it(tmp_path,
                                                                                              hf_model_dir):
    model_dir, text = hf_model_dir
    corpus = tmp_path / "big.txt"
    _write_corpus(corpus, text)
    size = corpus.stat().st_size
    results = run_distributed(_tokenize_and_read, 2, str(corpus), str(model_dir))
    print(f"\ncorpus {size / 1e6:.1f} MB, {results[0]['tokens']} tokens; {results}")
    assert results[0]["tokens"] > 5_000_000 and results[0]["batches"] == results[1]["batches"] > 1000
    assert results[0]["tokenizing"] <= 0.10 * size
    assert all(r["reading"] <= 0.10 * size for r in results)
