"""What a policy needs to build parallel modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_seqpar.tensor_parallel.collectives import ParallelGroup
from lightning_seqpar.tensor_parallel.random import RNGTracker


@dataclass
class RewriteContext:
    """Arguments shared by every policy of one rewrite.

    Attributes:
        group: the tensor-parallel group (size t).
        sequence_parallel: shard the LayerNorm/dropout/residual regions along s (ignored when t = 1).
        rng_tracker: dropout streams for sharded regions (``None``: the default generator only).
        loss_parallel: compute the LM loss on vocabulary-sharded logits instead of gathering them.
    """

    group: ParallelGroup
    sequence_parallel: bool = True
    rng_tracker: Optional[RNGTracker] = None
    loss_parallel: bool = True

    @property
    def tp(self) -> int:
        """t."""
        return self.group.size

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is in effect (t > 1 and asked for)."""
        return self.sequence_parallel and self.group.size > 1
