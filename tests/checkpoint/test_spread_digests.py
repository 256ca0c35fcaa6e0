"""Digests are computed once per file and run, the files spread over the ranks (``spread_digests``): every rank ends
with every digest, the files hashed in all add up to the files given, and a file a rank already hashed is read by none.
The frozen base of a LoRA checkpoint and a corpus's token cache are identified this way."""

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

SIZES = [7, 300_000, 5, 120_000, 40_000, 1]  # bytes: a large file goes first, to the rank with the least so far


def _files(root: Path) -> list[Path]:
    paths = []
    for index, size in enumerate(SIZES):
        path = root / f"shard-{index}.safetensors"
        path.write_bytes(bytes((index * 7 + i) % 251 for i in range(size)))
        paths.append(path)
    return paths


def _counting():
    import lightning_seqpar.checkpoint.content as content

    read: list[str] = []
    original = content.file_digest

    def counted(path):
        read.append(Path(path).name)
        return original(path)

    content.file_digest = counted
    return read


def _spread_case(rank, world, root):
    from lightning_seqpar.checkpoint.content import content_digest, spread_digests
    from lightning_seqpar.checkpoint.frozen_base import FrozenBase
    from lightning_seqpar.data import TextDataModule

    root = Path(root)
    paths = sorted(root.glob("shard-*.safetensors"))
    read = _counting()
    if rank == 2:
        content_digest(paths[1])  # hashed here before: no rank reads it again
    already = list(read)
    digests = spread_digests(paths)
    first = [name for name in read if name not in already]
    again = spread_digests(paths)  # everyone holds every digest now: nothing read
    local = {str(p.resolve()): content_digest(p) for p in paths}  # memo hits, no read
    after_spread = len(read)
    base = FrozenBase.of(root).with_digests()  # the checkpoint's record of a pretrained base, spread the same way
    corpus = root / "corpus"
    data = TextDataModule(str(corpus), tokenizer="bytes", block_size=8)
    data.trainer = SimpleNamespace(local_rank=rank, lightning_module=None)
    data.setup("fit")
    corpus_reads = [name for name in read[after_spread:] if name.endswith(".txt")]
    return dict(digests=digests, again=again, local=local, first=first, after_spread=after_spread,
                base=base.digests, corpus_reads=corpus_reads)


def test_each_file_is_hashed_by_one_rank_and_every_rank_gets_every_digest(tmp_path):
    paths = _files(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(3):
        (corpus / f"part-{index}.txt").write_text(f"document {index} " * 40)
    results = run_distributed(_spread_case, 4, str(tmp_path))
    expected = {str(p.resolve()): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    for result in results:
        assert result["digests"] == expected and result["again"] == expected and result["local"] == expected
        assert result["base"] == {Path(k).name: v for k, v in expected.items()}
    read = sorted(name for result in results for name in result["first"])
    assert read == sorted(p.name for i, p in enumerate(paths) if i != 1)  # once each; rank 2's earlier one not again
    assert [r["after_spread"] for r in results] == [len(r["first"]) + (1 if i == 2 else 0) for i, r in
                                                    enumerate(results)]
    # the largest unhashed file (120 kB) went to the rank with least so far, the rest balanced by bytes
    owners = {name: rank for rank, result in enumerate(results) for name in result["first"]}
    assert owners["shard-3.safetensors"] == 0 and owners["shard-4.safetensors"] == 1
    corpus_reads = sorted(name for result in results for name in result["corpus_reads"])
    assert corpus_reads == ["part-0.txt", "part-1.txt", "part-2.txt"]  # a three-file corpus read for its identity once


def test_without_a_process_group_the_files_are_hashed_here(tmp_path):
    from lightning_seqpar.checkpoint.content import spread_digests

    paths = _files(tmp_path)
    assert spread_digests(paths) == {str(p.resolve()): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    os.utime(paths[0], ns=(1, 1))  # the time changed: the change time too, so it is read again, with the same digest
    assert spread_digests(paths[:1]) == {str(paths[0].resolve()): hashlib.sha256(paths[0].read_bytes()).hexdigest()}
