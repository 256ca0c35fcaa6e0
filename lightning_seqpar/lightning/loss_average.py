"""How many per-micro-batch losses are averaged into one optimizer step's gradient under a strategy.

A loss that should be one process's mean over a step's supervised tokens divides each micro-batch's token sum by
``N / R``: ``N`` the step's supervised tokens (every data-parallel rank, every accumulated micro-batch), ``R`` what
this function returns. The strategy averages the gradients over the d data-parallel replicas (context-parallel ranks
hold one replica's loss between them: their sum), Lightning divides each accumulated micro-batch's loss by a, and the
pipeline schedule averages its m micro-batches: ``R = d · a · m``.
"""

from __future__ import annotations

from typing import Any


def pipeline_microbatches(trainer: Any) -> int:
    """m: the micro-batches a pipeline-parallel step splits each batch into (1 without pipeline parallelism)."""
    pipeline = getattr(trainer.strategy, "pipeline", None)
    return int(pipeline.config.num_microbatches) if pipeline is not None else 1


def data_parallel_replicas(trainer: Any) -> int:
    """d: the replicas that see different batches (SeqParallelStrategy's data-parallel size; under another strategy,
    its processes)."""
    layout = getattr(trainer.strategy, "layout", None)  # SeqParallelStrategy's Layout
    return layout.dims(trainer.world_size).dp if layout is not None else trainer.world_size


def loss_replicas(trainer: Any) -> int:
    """``d · a · m`` (see the module docstring)."""
    return data_parallel_replicas(trainer) * trainer.accumulate_grad_batches * pipeline_microbatches(trainer)
