"""Rows read from the cache when a micro-batch asks are the rows packing makes in memory: the same tokens, labels,
position ids or masks and supervised counts, packed or padded, refused or truncated alike; and a rank holds an index
of 8 bytes per example and 16 per row, not the tokens."""

from pathlib import Path

import numpy as np
import pytest

from lightning_seqpar.data.cached_rows import CachedRows
from lightning_seqpar.data.packing import pack_examples
from lightning_seqpar.data.supervised import SupervisedExample
from lightning_seqpar.data.supervised_cache import SupervisedCache


def _cache(lengths, seed=0):
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    ids = rng.integers(3, 500, total).astype(np.int32)
    flags = (rng.random(total) < 0.5).astype(np.uint8)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    predicted = np.asarray([int(flags[a + 1:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])], dtype=np.int64)
    cache = SupervisedCache(Path("cache"), {}, ids, flags, np.asarray(lengths, dtype=np.int64), predicted)
    examples = [SupervisedExample(ids[a:b], flags[a:b].view(bool)) for a, b in zip(bounds[:-1], bounds[1:])]
    return cache, examples


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("first, last", [(0, 40), (13, 40), (0, 1)])
def test_cached_rows_are_the_rows_packing_makes(packing, first, last):
    lengths = np.random.default_rng(1).integers(1, 20, 40)
    lengths[[5, 17, 30]] = [24, 31, 50]  # longer than the block: truncated
    cache, examples = _cache(lengths)
    rows = CachedRows(cache, first, last, 24, 2, packing, "truncate", lambda i: f"record {i + 1}")
    expected = pack_examples(examples[first:last], 24, 2, packing, "truncate")
    assert len(rows) == len(expected)
    for got, want in zip(rows.take(np.arange(len(rows))), (expected.input_ids, expected.labels, expected.second)):
        assert np.array_equal(got, want)
    assert np.array_equal(rows.supervised, expected.supervised)
    picked = np.array([len(rows) - 1, 0])
    assert np.array_equal(rows.take(picked)[1], expected.labels[picked])


def test_an_example_longer_than_the_block_is_refused_as_packing_refuses_it():
    cache, examples = _cache([5, 30, 4])
    with pytest.raises(ValueError) as cached:
        CachedRows(cache, 0, 3, 24, 2, True, "refuse", lambda i: f"chat.jsonl: record {i + 1}")
    with pytest.raises(ValueError) as packed:
        pack_examples(examples, 24, 2, True, "refuse", [f"chat.jsonl: record {i + 1}" for i in range(3)])
    assert str(cached.value) == str(packed.value) and str(cached.value).startswith("chat.jsonl: record 2: 30 tokens")


def test_a_rank_holds_an_index_not_the_tokens():
    lengths = np.full(1000, 100)
    cache, _ = _cache(lengths)
    rows = CachedRows(cache, 0, 1000, 512, 2, True, "refuse", str)
    held = rows.offsets.nbytes + rows.fitted.nbytes + rows.row_starts.nbytes + rows.supervised.nbytes
    assert held <= 8 * (len(lengths) + 1) * 2 + 16 * (len(rows) + 1)
    assert held * 10 < cache.ids.nbytes + cache.supervised.nbytes  # the packed rows would be [rows, 512] × 3 int64
