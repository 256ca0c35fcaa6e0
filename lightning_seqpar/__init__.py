"""lightning_seqpar: Megatron-style tensor, sequence and pipeline parallelism for ordinary LightningModules.

Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (2022).

The names below are imported when first used (PEP 562), so ``import lightning_seqpar`` (or one of its torch-only
parts: ``tensor_parallel``, ``parallel``, ``memory``) loads neither Lightning nor, through it, the optional
extras. ``Trainer(strategy="seq_parallel")`` and its ``_tp2``/``_tp4``/``_tp8`` names resolve once the strategy
is imported, and at once when Lightning was imported first.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS = {
    "ActivationOffload": "lightning_seqpar.lightning.callbacks",
    "BlockSpec": "lightning_seqpar.transformer.block_spec",
    "ColumnParallelLinear": "lightning_seqpar.tensor_parallel",
    "AttentionSpec": "lightning_seqpar.transformer.attention_part",
    "AutoLayout": "lightning_seqpar.lightning.auto_layout",
    "DenseMLPSpec": "lightning_seqpar.transformer.mlp_part",
    "DispatchConfig": "lightning_seqpar.moe.dispatch_config",
    "Layout": "lightning_seqpar.layout",
    "CheckpointConfig": "lightning_seqpar.lightning.config",
    "LaunchConfig": "lightning_seqpar.lightning.config",
    "PrecisionConfig": "lightning_seqpar.lightning.config",
    "RewriteConfig": "lightning_seqpar.lightning.config",
    "ParallelDims": "lightning_seqpar.parallel.dims",
    "Placement": "lightning_seqpar.parallel.placement",
    "CommunicationLog": "lightning_seqpar.parallel",
    "CompileConfig": "lightning_seqpar.transformer.compiling",
    "DeclaredBlockPolicy": "lightning_seqpar.rewriting.declared_policy",
    "ModelPolicy": "lightning_seqpar.rewriting",
    "StackPolicy": "lightning_seqpar.rewriting",
    "FlopsUtilization": "lightning_seqpar.lightning.callbacks",
    "HostSyncCounter": "lightning_seqpar.lightning.callbacks",
    "ParallelGroup": "lightning_seqpar.parallel",
    "ParallelMesh": "lightning_seqpar.parallel.mesh",
    "Policy": "lightning_seqpar.rewriting",
    "RNGTracker": "lightning_seqpar.parallel",
    "RewriteContext": "lightning_seqpar.rewriting",
    "RowParallelLinear": "lightning_seqpar.tensor_parallel",
    "SampleText": "lightning_seqpar.lightning.callbacks",
    "SelectiveRecompute": "lightning_seqpar.lightning.callbacks",
    "Preemption": "lightning_seqpar.lightning.preemption",
    "SeqParallelStrategy": "lightning_seqpar.lightning.strategy",
    "VocabParallelEmbedding": "lightning_seqpar.tensor_parallel",
    "apply_recompute": "lightning_seqpar.recompute",
    "context_parallel_batch": "lightning_seqpar.context_parallel",
    "explain": "lightning_seqpar.plan.explain",
    "generate": "lightning_seqpar.generation",
    "rewrite": "lightning_seqpar.policies",
    "validate_layout": "lightning_seqpar.parallel.mesh",
    "vocab_parallel_cross_entropy": "lightning_seqpar.tensor_parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_seqpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "lightning.pytorch" in sys.modules:  # Lightning is loaded already: the strategy's names cost nothing more
    importlib.import_module("lightning_seqpar.lightning")
