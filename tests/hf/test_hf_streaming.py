"""Safetensors files written one tensor at a time read back with the safetensors package; shards are reassembled in
pieces exactly as the single-device tensor; files are cut as save_pretrained cuts them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from lightning_seqpar.checkpoint.hf_export import parse_size, unsharded_pieces
from lightning_seqpar.hf.streaming import (
    SafetensorsStreamWriter, TensorEntry, file_names, split_into_files, write_index,
)
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.placement import ShardSpec


def test_a_streamed_file_reads_back_bit_for_bit(tmp_path):
    tensors = {"a": torch.randn(3, 5, dtype=torch.float64), "b": torch.randn(7).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.randn(4, 2)}
    entries = [TensorEntry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with SafetensorsStreamWriter(tmp_path / "x.safetensors", entries) as writer:
        writer.write("a", tensors["a"])
        writer.write_pieces("b", [tensors["b"][:3], tensors["b"][3:]])
        writer.write("c", tensors["c"])
        writer.write("d", tensors["d"].double())  # cast to the entry's dtype on the way
    read = load_file(tmp_path / "x.safetensors")
    assert set(read) == set(tensors)
    for name, value in tensors.items():
        assert read[name].dtype == value.dtype and torch.equal(read[name], value), name


def test_a_stream_refuses_wrong_order_wrong_size_and_missing_tensors(tmp_path):
    entries = [TensorEntry("a", torch.float32, (2,)), TensorEntry("b", torch.float32, (3,))]
    with pytest.raises(ValueError, match="'b' written where 'a' comes next"):
        with SafetensorsStreamWriter(tmp_path / "x.safetensors", entries) as writer:
            writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="'a' got 12 bytes, its entry holds 8"):
        with SafetensorsStreamWriter(tmp_path / "x.safetensors", entries) as writer:
            writer.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="closed after 1 of 2 tensors"):
        with SafetensorsStreamWriter(tmp_path / "x.safetensors", entries) as writer:
            writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="'z' is torch.complex64, which safetensors cannot store"):
        SafetensorsStreamWriter(tmp_path / "y.safetensors", [TensorEntry("z", torch.complex64, (1,))])


@pytest.mark.parametrize("spec, shape", [
    (ShardSpec(0, 13, 14), (13, 4)),              # vocabulary padding on the last rank
    (ShardSpec(0, 12, 12, chunks=3), (12, 4)),    # fused [q; k; v] split per block
    (ShardSpec(0, 16, 16, 3, (8, 4, 4)), (16, 4)),  # ... of unequal blocks (grouped-query attention)
    (ShardSpec(1, 6, 6), (5, 6)),                 # row-parallel: split along dim 1
    (ShardSpec(1, 12, 12, chunks=3), (4, 12)),    # GPT-2's Conv1D c_attn: fused along dim 1
])
def test_shards_are_reassembled_in_pieces_as_the_single_device_tensor(spec, shape, monkeypatch):
    import lightning_seqpar.checkpoint.hf_export as export

    monkeypatch.setattr(export, "_BLOCK_BYTES", 16)  # several blocks of rows
    full = torch.randn(shape)
    shards = [spec.shard(full, ParallelGroup.virtual(2, rank)) for rank in range(2)]
    pieces = list(unsharded_pieces(shards, spec))
    assert len(pieces) > 1
    torch.testing.assert_close(torch.cat([p.reshape(-1) for p in pieces]), full.reshape(-1), rtol=0, atol=0)


def test_files_are_cut_by_size_within_each_writer_and_indexed(tmp_path):
    entry = lambda name, n: TensorEntry(name, torch.float32, (n,))  # noqa: E731
    files = split_into_files([[entry("a", 10), entry("b", 10), entry("c", 30)], [entry("d", 5)]], 80)
    assert [[e.name for e in f] for f in files] == [["a", "b"], ["c"], ["d"]]
    assert file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert file_names(1) == ["model.safetensors"]
    write_index(tmp_path, files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 55 * 4
    assert index["weight_map"] == {"a": file_names(3)[0], "b": file_names(3)[0], "c": file_names(3)[1],
                                   "d": file_names(3)[2]}


def test_sizes_are_read_as_save_pretrained_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("20KB") == 20_000 and parse_size("4GiB") == 4 * 2**30
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size='five' is not a size"):
        parse_size("five")
