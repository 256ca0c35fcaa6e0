"""Context parallelism: the sequence split over c more ranks, attention included (ring or all-to-all), with causal
load balancing, packed documents, padding and sliding windows kept exact."""

from lightning_seqpar.context_parallel.attention import check_all_to_all_heads, context_parallel_attention
from lightning_seqpar.context_parallel.batch import RankBatch, context_parallel_batch
from lightning_seqpar.context_parallel.layout import (
    LAYOUT_ARGUMENT, ContextParallelBatch, check_context_length, documents_from_positions, local_indices,
)
from lightning_seqpar.context_parallel.comms import COMMS
from lightning_seqpar.context_parallel.runtime import ContextParallel

__all__ = ["COMMS", "LAYOUT_ARGUMENT", "ContextParallel", "ContextParallelBatch", "RankBatch", "check_all_to_all_heads",
           "check_context_length", "context_parallel_attention", "context_parallel_batch", "documents_from_positions",
           "local_indices"]
