"""The gradient reduction around one optimizer step's closure, for a replicated or a distributed optimizer."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch.nn as nn
from torch.optim import Optimizer

from lightning_seqpar.optim.distributed_optimizer import DistributedOptimizer, distribute_optimizers
from lightning_seqpar.optim.grad_buckets import BucketArming, Buckets, NoBuckets, gradient_buckets
from lightning_seqpar.optim.gradients import finalize_gradients
from lightning_seqpar.parallel.mesh import ParallelMesh


@contextmanager
def reduced_gradients(optimizer: Optimizer, buckets: Buckets, parameters: Callable[[], Iterable[nn.Parameter]],
                      mesh: ParallelMesh) -> Iterator[BucketArming]:
    """Around the closure of an optimizer step (it runs the last backward of the accumulation window): buckets
    reduce during that backward, and on leaving, the gradients are those of the unparallelized model, ready for
    clipping. ``optimizer``: a :class:`DistributedOptimizer` reduce-scatters its own buckets and keeps the owned
    ranges (:meth:`~DistributedOptimizer.finish_gradients`); any other is preceded by ``buckets`` and
    :func:`~lightning_seqpar.optim.finalize_gradients` over ``parameters()``. Yields the buckets in use (a pipeline
    schedule arms them for its last backward)."""
    if isinstance(optimizer, DistributedOptimizer):
        with optimizer.buckets.reducing():
            yield optimizer.buckets
        optimizer.finish_gradients()
        return
    with buckets.reducing():
        yield buckets
    finalize_gradients(parameters(), mesh, buckets.finish())


def data_parallel_optimizers(module: nn.Module, optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any],
                             mesh: ParallelMesh, zero: int, pipelined: bool, previous: Buckets,
                             main_params: bool = False) -> tuple[list[Optimizer], Buckets]:
    """The optimizers a run steps and the buckets that reduce for them, replacing ``previous`` (a second ``fit``):
    ``zero=1``, :class:`DistributedOptimizer` for each (they bucket their own gradients; ``main_params``: float32
    main params of 16-bit parameters); ``zero=0``, the optimizers as they are and
    :class:`~lightning_seqpar.optim.grad_buckets.GradientBuckets` over ``module``.

    Raises:
        ValueError: from :class:`DistributedOptimizer`.
    """
    previous.remove()
    if zero:
        if main_params and not any(p.element_size() < 4 for p in module.parameters()):
            warnings.warn("fp32_main_params=True has no effect: the parameters are not 16-bit (precision='bf16-mixed' "
                          "keeps float32 parameters already). Use precision='bf16-true' for 16-bit parameters with "
                          "float32 main params.", stacklevel=2)
        return list(distribute_optimizers(optimizers, lr_scheduler_configs, mesh, pipelined, main_params)), NoBuckets()
    return list(optimizers), gradient_buckets(module, mesh.data, pipelined)
