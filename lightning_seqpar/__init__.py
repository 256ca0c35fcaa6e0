"""lightning_seqpar: Megatron-style tensor, sequence and pipeline parallelism for ordinary LightningModules.

Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (2022).
"""

from lightning_seqpar.lightning.callbacks import FlopsUtilization, SelectiveRecompute
from lightning_seqpar.lightning.strategy import SeqParallelStrategy, register
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup, RNGTracker
from lightning_seqpar.parallel.mesh import ParallelMesh, validate_layout
from lightning_seqpar.recompute import apply_recompute
from lightning_seqpar.rewrite import Policy, RewriteContext, explain, rewrite
from lightning_seqpar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.declared_policy import DeclaredBlockPolicy

register()

__all__ = [
    "BlockSpec",
    "ColumnParallelLinear",
    "DeclaredBlockPolicy",
    "CommunicationLog",
    "FlopsUtilization",
    "ParallelGroup",
    "ParallelMesh",
    "Policy",
    "RNGTracker",
    "RewriteContext",
    "RowParallelLinear",
    "SelectiveRecompute",
    "SeqParallelStrategy",
    "VocabParallelEmbedding",
    "apply_recompute",
    "explain",
    "rewrite",
    "validate_layout",
    "vocab_parallel_cross_entropy",
]
