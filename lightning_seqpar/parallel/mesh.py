"""The ``(pipeline, data, tensor)`` process mesh, tensor-parallel ranks fastest.

Megatron-LM orders ranks so that a tensor-parallel group is made of neighbouring devices (the
fastest links): ``rank = tp_rank + t · (dp_rank + d · pp_rank)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_seqpar._compat import set_process_group_timeout
from lightning_seqpar.parallel.collectives import ParallelGroup


def validate_layout(world_size: int, tp: int, pp: int) -> int:
    """Check a parallel layout and return the data-parallel size ``d = world_size // (tp · pp)``.

    Raises:
        ValueError: if ``tp`` or ``pp`` is not a positive integer, or ``world_size`` is not
            divisible by ``tp · pp``. Called before any collective, so no process hangs.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if world_size % (tp * pp):
        raise ValueError(
            f"The world size ({world_size} processes) is not divisible by tp·pp = {tp}·{pp} = {tp * pp}. "
            f"Launch a multiple of {tp * pp} processes (devices × nodes) or change `tp`/`pp`."
        )
    return world_size // (tp * pp)


@dataclass(frozen=True)
class ParallelMesh:
    """Process groups of one rank in a ``(pp, dp, tp)`` layout: the one source of its ranks and sizes.

    Attributes:
        tensor: the tensor-parallel group of this rank (size t).
        data: the data-parallel group of this rank (size d).
        pipeline: the pipeline-parallel group of this rank (size p).
        device_mesh: the underlying ``torch.distributed.DeviceMesh`` (``None`` for a single process).
        first_and_last: for ``p > 2``, the group of the first and the last pipeline stage of this rank's
            ``(data, tensor)`` coordinate when this rank is one of them (:attr:`embedding`).
        host_groups: gloo twins of the data, pipeline and first-and-last groups, ``{"data": ..., ...}``, when the
            default backend is not gloo (NCCL): flags the host already knows (which parameters got a gradient) are
            exchanged on them in host memory, with no device synchronization (Megatron-LM's
            ``get_data_parallel_group_gloo``). Empty under gloo, whose groups serve as they are.
    """

    tensor: ParallelGroup
    data: ParallelGroup
    pipeline: ParallelGroup
    device_mesh: Optional[object] = None
    first_and_last: Optional[ParallelGroup] = None
    host_groups: Mapping[str, ParallelGroup] = field(default_factory=dict)

    @property
    def embedding(self) -> ParallelGroup:
        """The first and the last pipeline stage of this rank's pipeline (Megatron-LM's embedding group): where
        the gradients of a tied embedding and LM head are summed. The pipeline group itself when ``p <= 2``; a
        group of one rank on middle stages (they hold no such parameter)."""
        if self.pipeline.size <= 2:
            return self.pipeline
        return self.first_and_last if self.first_and_last is not None else ParallelGroup(None)

    def host(self, name: str) -> ParallelGroup:
        """The group ``name`` (``"data"``, ``"pipeline"`` or ``"embedding"``) for exchanging host-side values: CPU
        tensors, reduced without touching the device (:attr:`host_groups`)."""
        if name in self.host_groups:
            return self.host_groups[name]
        return {"data": self.data, "pipeline": self.pipeline, "embedding": self.embedding}[name]

    @property
    def tp(self) -> int:
        """t, the tensor-parallel size."""
        return self.tensor.size

    @property
    def dp(self) -> int:
        """d, the data-parallel size."""
        return self.data.size

    @property
    def pp(self) -> int:
        """p, the pipeline-parallel size."""
        return self.pipeline.size

    @classmethod
    def single(cls) -> "ParallelMesh":
        """The mesh of an unparallelized run: every group has one rank."""
        return cls(ParallelGroup(None), ParallelGroup(None), ParallelGroup(None))

    @classmethod
    def build(cls, tp: int, pp: int, device_type: str, host_groups: Optional[bool] = None,
              timeout: Optional[timedelta] = None) -> "ParallelMesh":
        """Build the mesh over the initialized default process group.

        ``host_groups``: create the gloo twins of :attr:`host_groups` (default: when the backend is not gloo).
        ``timeout``: how long every group's collectives wait for a peer (default: torch's 30 minutes); the same for
        all of them, so a stalled peer ends the job after the strategy's timeout whichever group it stalls.

        Raises:
            ValueError: from :func:`validate_layout`.
            RuntimeError: if ``torch.distributed`` is not initialized.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs an initialized torch.distributed process group.")
        dp = validate_layout(dist.get_world_size(), tp, pp)
        device_mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pipeline", "data", "tensor"))
        if timeout is not None:
            for name in ("pipeline", "data", "tensor"):
                set_process_group_timeout(timeout, device_mesh.get_group(name))

        def group(name: str) -> ParallelGroup:
            return ParallelGroup(device_mesh.get_group(name))

        first_and_last = _new_groups([[c, c + (pp - 1) * dp * tp] for c in range(dp * tp)], None, timeout,
                                     "first_and_last_stage") if pp > 2 else None
        if host_groups is None:
            host_groups = dist.get_backend() != "gloo"
        host: dict[str, ParallelGroup] = {}
        if host_groups:
            ranks = lambda p_, d_, t_: t_ + tp * (d_ + dp * p_)  # noqa: E731  (the mesh's rank order)
            host["data"] = _new_groups([[ranks(p_, d_, t_) for d_ in range(dp)] for p_ in range(pp) for t_ in range(tp)],
                                       "gloo", timeout, "host_data")
            host["pipeline"] = _new_groups([[ranks(p_, d_, t_) for p_ in range(pp)] for d_ in range(dp)
                                            for t_ in range(tp)], "gloo", timeout, "host_pipeline")
            if pp > 2:
                embedding = _new_groups([[c, c + (pp - 1) * dp * tp] for c in range(dp * tp)], "gloo", timeout,
                                        "host_first_and_last_stage")
                host["embedding"] = embedding if embedding is not None else ParallelGroup(None)
            elif pp == 2:
                host["embedding"] = host["pipeline"]
        return cls(group("tensor"), group("data"), group("pipeline"), device_mesh, first_and_last, host)


def _new_groups(all_ranks: list[list[int]], backend: Optional[str] = None, timeout: Optional[timedelta] = None,
                description: Optional[str] = None) -> Optional[ParallelGroup]:
    """Create one process group per rank list (every rank creates every group, in the same order:
    ``torch.distributed.new_group``'s rule) and return the one holding this rank, if any."""
    rank, mine = dist.get_rank(), None
    for ranks in all_ranks:
        created = dist.new_group(ranks, backend=backend, timeout=timeout, group_desc=description)
        if rank in ranks:
            mine = ParallelGroup(created)
    return mine
