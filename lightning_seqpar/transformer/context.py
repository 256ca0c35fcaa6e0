"""What a policy needs to build parallel modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn as nn

from lightning_seqpar.tensor_parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.random import RNGTracker
from lightning_seqpar.transformer.materialize import Initializer, Materializer, has_meta_tensors, to_empty


@dataclass
class RewriteContext:
    """Arguments shared by every policy of one rewrite.

    Attributes:
        group: the tensor-parallel group (size t).
        sequence_parallel: shard the LayerNorm/dropout/residual regions along s (ignored when t = 1).
        rng_tracker: dropout streams for sharded regions (``None``: the default generator only).
        loss_parallel: compute the LM loss on vocabulary-sharded logits instead of gathering them.
        materialize: gives meta-device single-device blocks real weights just before they are sliced
            (``None``: every module must already be materialized).
        held_layers: for pipeline parallelism, ``held_layers(L)`` is the set of indices of a stack of L layers
            that this rank keeps; the others stay on the meta device (they are dropped by the stage split).
    """

    group: ParallelGroup
    sequence_parallel: bool = True
    rng_tracker: Optional[RNGTracker] = None
    loss_parallel: bool = True
    materialize: Optional[Materializer] = None
    held_layers: Optional[Callable[[int], set[int]]] = None

    def prepare(self, module: nn.Module, name: str, init: Optional[Initializer] = None) -> None:
        """Materialize ``module`` if it was built on the meta device (see :class:`Materializer`).

        Raises:
            ValueError: a meta-device module and no materializer (the strategy provides one).
        """
        if self.materialize is not None:
            self.materialize(module, name, init)
        elif has_meta_tensors(module):
            raise ValueError(f"'{name}' is on the meta device; rewrite it through SeqParallelStrategy, which materializes it.")

    def build(self, original: nn.Module, name: str, construct: Callable[[nn.Module], nn.Module],
              init: Optional[Initializer] = None, held: bool = True) -> nn.Module:
        """``construct(original)``, the parallel version of a block; for a block on the meta device, its shards
        are allocated first, then filled from the single-device block materialized one submodule at a time.
        A block this rank does not hold (``held=False``) stays on the meta device.

        Raises:
            ValueError: a meta-device block and no materializer.
        """
        if not held or not has_meta_tensors(original):
            return construct(original)
        if self.materialize is None:
            raise ValueError(f"'{name}' is on the meta device; rewrite it through SeqParallelStrategy, which materializes it.")
        parallel = construct(original)  # meta skeleton: the slices' shapes
        to_empty(parallel, self.materialize.device)
        self.materialize.into(parallel, original, name, self.group, init)
        return parallel

    def holds(self, index: int, num_layers: int) -> bool:
        """Whether this rank keeps layer ``index`` of a stack of ``num_layers`` (pipeline parallelism)."""
        return self.held_layers is None or index in self.held_layers(num_layers)

    @property
    def tp(self) -> int:
        """t."""
        return self.group.size

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is in effect (t > 1 and asked for)."""
        return self.sequence_parallel and self.group.size > 1
