"""What a policy needs to build parallel modules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_seqpar.context_parallel.runtime import ContextParallel
from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import placement_of
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.transformer.masks import MaskCache
from lightning_seqpar.transformer.materialize import Initializer, Materializer, has_meta_tensors


@dataclass
class RewriteContext:
    """Arguments shared by every policy of one rewrite.

    Attributes:
        group: the tensor-parallel group (size t).
        sequence_parallel: shard the LayerNorm/dropout/residual regions along s (ignored when t = 1).
        rng_tracker: dropout streams for sharded regions (``None``: the default generator only).
        loss_parallel: compute the LM loss on vocabulary-sharded logits instead of gathering them.
        materialize: gives meta-device single-device modules real weights: small ones (embeddings, norms)
            just before they are sliced, blocks after the stage split (``None``: nothing may be on meta).
        masks: the torch-convention mask combination the rewritten layers share (:class:`MaskCache`).
        context: context parallelism (c > 1: the sequence split over a cp group as well), or ``None``.
        loss_chunk: positions of the sequence whose logits a Hugging Face model's vocabulary-parallel loss computes at
            once (:meth:`~lightning_seqpar.tensor_parallel.vocab_logits.VocabShardedLogits.over_chunks`); ``None``:
            all of them.
        expert_group: the expert-parallel group (size e: ranks holding different experts of each mixture-of-experts
            layer; :mod:`lightning_seqpar.moe`); ``None``: one rank, every expert here.
        expert_tp_group: the expert tensor-parallel group (size etp: ranks holding different slices of each expert's
            width); ``None``: one rank, whole experts.
        expert_dispatch_group: the ``etp_ep`` group a mixture's tokens are dispatched over when ``etp > 1``.
        data_group: the data-parallel and context-parallel replicas (``dp_cp``, size d·c: other tokens of the same
            step), which a loss over every token of the step (a mixture's load-balancing loss) sums over; ``None``: one.
        dispatch: how a mixture of experts sends its tokens (dropless, or with a capacity).
    """

    group: ParallelGroup
    sequence_parallel: bool = True
    rng_tracker: Optional[RNGTracker] = None
    loss_parallel: bool = True
    materialize: Optional[Materializer] = None
    masks: MaskCache = field(default_factory=MaskCache)
    context: Optional[ContextParallel] = None
    loss_chunk: Optional[int] = None
    expert_group: Optional[ParallelGroup] = None
    expert_tp_group: Optional[ParallelGroup] = None
    expert_dispatch_group: Optional[ParallelGroup] = None
    data_group: Optional[ParallelGroup] = None
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)

    @classmethod
    def of(cls, layout: Any, mesh: ParallelMesh, rng_tracker: Optional[RNGTracker] = None,
           materialize: Optional[Materializer] = None) -> "RewriteContext":
        """The one way a rank's rewrite context is made: ``layout``'s settings (a :class:`~lightning_seqpar.Layout`:
        sequence and loss parallelism, ``cp_comm``, ``loss_chunk``, the experts' dispatch) over ``mesh``'s groups,
        real (the run) or :meth:`~lightning_seqpar.parallel.mesh.ParallelMesh.virtual` (the dry run, the planner's
        inventory, the strategy's checks before any rank starts, ``explain``). Read by attribute: this layer sits
        below the layout's module."""
        return cls(mesh.tensor, layout.sequence_parallel, rng_tracker, layout.loss_parallel, materialize,
                   context=ContextParallel(mesh.context, layout.cp_comm), loss_chunk=layout.loss_chunk,
                   expert_group=mesh.group("ep"), expert_tp_group=mesh.group("etp"),
                   expert_dispatch_group=mesh.group("etp_ep"), data_group=mesh.data, dispatch=layout.moe)

    def emulated(self, group: ParallelGroup) -> "RewriteContext":
        """This rewrite on emulated tensor-parallel ranks ``group``: what a self-check builds its small copy with.
        Sequence and loss parallelism kept; experts split over the same emulated ranks where this rewrite splits them
        (their dispatch runs too, dropless: the check compares with one device); no streams, materializer,
        context-parallel or data group."""
        return RewriteContext(group, self.sequence_parallel, None, self.loss_parallel,
                              expert_group=group if self.ep > 1 else None)

    def prepare(self, module: nn.Module, name: str, init: Optional[Initializer] = None) -> None:
        """Materialize ``module`` if it was built on the meta device (see :class:`Materializer`).

        Raises:
            ValueError: a meta-device module and no materializer (the strategy provides one).
        """
        if has_meta_tensors(module):
            self._materializer(name)(module, name, init)

    def build(self, original: nn.Module, name: str, construct: Callable[[nn.Module], nn.Module],
              init: Optional[Initializer] = None) -> nn.Module:
        """``construct(original)``, the parallel version of a block. A block on the meta device gives a meta
        skeleton whose shards are allocated and filled later, by :meth:`Materializer.fill` (after the stage
        split, so other stages' layers never are).

        Raises:
            ValueError: a meta-device block and no materializer.
        """
        if not has_meta_tensors(original):
            return construct(original)
        materializer = self._materializer(name)
        parallel = construct(original)  # meta skeleton: the slices' shapes
        materializer.pending.append((parallel, original, name, init))
        return parallel

    def _materializer(self, name: str) -> Materializer:
        if self.materialize is None:
            raise ValueError(f"'{name}' is on the meta device; rewrite it through SeqParallelStrategy, which materializes it.")
        return self.materialize

    @property
    def tp(self) -> int:
        """t."""
        return self.group.size

    @property
    def cp(self) -> int:
        """c (1 without context parallelism)."""
        return 1 if self.context is None else self.context.c

    def shard_group(self, tensor: torch.Tensor) -> ParallelGroup:
        """The group ``tensor``'s shards are split over: the expert-parallel group for experts, else tensor parallel."""
        expert = placement_of(tensor).shard_over == "ep" and self.expert_group is not None
        return self.expert_group if expert else self.group  # type: ignore[return-value]

    def inner_shard_group(self, tensor: torch.Tensor) -> Optional[ParallelGroup]:
        """The group of ``tensor``'s second split (an expert's width over the expert tensor-parallel group); ``None``
        for a tensor split once or not."""
        return self.expert_tp_group if placement_of(tensor).inner is not None else None

    @property
    def expert_tp(self) -> int:
        """etp, the expert tensor-parallel size (1: whole experts on each rank)."""
        return 1 if self.expert_tp_group is None else self.expert_tp_group.size

    @property
    def ep(self) -> int:
        """e, the expert-parallel size (1: every expert on this rank)."""
        return 1 if self.expert_group is None else self.expert_group.size

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is in effect (t > 1 and asked for)."""
        return self.sequence_parallel and self.group.size > 1
