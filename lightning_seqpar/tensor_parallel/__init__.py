"""Tensor-parallel layers (column, row, vocabulary), the conjugate operators f/f̄/g/ḡ, the vocabulary-parallel
loss, and how a parameter is sharded (``ShardSpec`` and the parameter tags)."""

from lightning_seqpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_seqpar.tensor_parallel.embedding import VocabParallelEmbedding
from lightning_seqpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_seqpar.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from lightning_seqpar.parallel.placement import ShardSpec

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy",
]
