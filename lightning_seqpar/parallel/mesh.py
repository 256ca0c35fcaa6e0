"""The ``(pipeline, data, context, tensor)`` process mesh, tensor-parallel ranks fastest, then context-parallel.

Megatron-LM orders ranks so that a tensor-parallel group is made of neighbouring devices (the
fastest links), context-parallel ranks next: ``rank = tp_rank + t · (cp_rank + c · (dp_rank + d · pp_rank))``.
Parameters are replicated over context-parallel ranks as over data-parallel ones, and their gradients are reduced
over both together: the ``data`` group of the mesh is that ``d · c`` group (Megatron-LM's data-parallel group
"with context parallel"), so the gradient buckets and the distributed optimizer need no second reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_seqpar._compat import set_process_group_timeout
from lightning_seqpar.parallel.collectives import ParallelGroup


def validate_layout(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """Check a parallel layout and return the size of the gradient-reduction group ``d · c = world_size // (tp · pp)``
    (the data-parallel size d times the context-parallel size c).

    Raises:
        ValueError: if ``tp``, ``pp`` or ``cp`` is not a positive integer, or ``world_size`` is not
            divisible by ``tp · cp · pp``. Called before any collective, so no process hangs.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    unit = tp * cp * pp
    if world_size % unit:
        names = "tp·pp" if cp == 1 else "tp·cp·pp"
        values = f"{tp}·{pp}" if cp == 1 else f"{tp}·{cp}·{pp}"
        raise ValueError(
            f"The world size ({world_size} processes) is not divisible by {names} = {values} = {unit}. "
            f"Launch a multiple of {unit} processes (devices × nodes) or change `tp`/`pp`{'/`cp`' if cp > 1 else ''}."
        )
    return world_size // (tp * pp)


@dataclass(frozen=True)
class ParallelMesh:
    """Process groups of one rank in a ``(pp, dp, cp, tp)`` layout: the one source of its ranks and sizes.

    Attributes:
        tensor: the tensor-parallel group of this rank (size t).
        data: the group over which parameters are replicated and gradients reduced: the data-parallel ranks and,
            under context parallelism, their context-parallel ranks (size ``d · c``; rank ``dp_rank · c + cp_rank``).
        pipeline: the pipeline-parallel group of this rank (size p).
        device_mesh: the underlying ``torch.distributed.DeviceMesh`` (``None`` for a single process).
        first_and_last: for ``p > 2``, the group of the first and the last pipeline stage of this rank's
            ``(data, tensor)`` coordinate when this rank is one of them (:attr:`embedding`).
        host_groups: gloo twins of the data, pipeline and first-and-last groups, ``{"data": ..., ...}``, when the
            default backend is not gloo (NCCL): flags the host already knows (which parameters got a gradient) are
            exchanged on them in host memory, with no device synchronization (Megatron-LM's
            ``get_data_parallel_group_gloo``). Empty under gloo, whose groups serve as they are.
        context: the context-parallel group of this rank (size c): ranks holding other tokens of the same
            sequences, inside ``data``.
    """

    tensor: ParallelGroup
    data: ParallelGroup
    pipeline: ParallelGroup
    device_mesh: Optional[object] = None
    first_and_last: Optional[ParallelGroup] = None
    host_groups: Mapping[str, ParallelGroup] = field(default_factory=dict)
    context: ParallelGroup = field(default_factory=ParallelGroup)

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
        """d, the data-parallel size: replicas that see different batches (``data`` holds ``d · c`` ranks)."""
        return self.data.size // self.context.size

    @property
    def cp(self) -> int:
        """c, the context-parallel size."""
        return self.context.size

    @property
    def batch_rank(self) -> int:
        """This rank's data-parallel rank (which batch it reads): context-parallel peers read the same one."""
        return self.data.rank // self.context.size

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
              timeout: Optional[timedelta] = None, cp: int = 1) -> "ParallelMesh":
        """Build the mesh over the initialized default process group.

        The ``torch.distributed`` device mesh is ``(pipeline, data, tensor)`` with ``data`` of size ``d · c``: with
        context-parallel ranks next to tensor-parallel ones, that flattening is the same rank order. ``cp``: c, whose
        groups are cut out of ``data``.

        ``host_groups``: create the gloo twins of :attr:`host_groups` (default: when the backend is not gloo).
        ``timeout``: how long every group's collectives wait for a peer (default: torch's 30 minutes); the same for
        all of them, so a stalled peer ends the job after the strategy's timeout whichever group it stalls.

        Raises:
            ValueError: from :func:`validate_layout`.
            RuntimeError: if ``torch.distributed`` is not initialized.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs an initialized torch.distributed process group.")
        dp = validate_layout(dist.get_world_size(), tp, pp, cp)  # d · c
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
        context = _new_groups([[t_ + tp * (d_ + dp * p_) for d_ in range(g * cp, (g + 1) * cp)]
                               for p_ in range(pp) for g in range(dp // cp) for t_ in range(tp)],
                              None, timeout, "context") if cp > 1 else None
        return cls(group("tensor"), group("data"), group("pipeline"), device_mesh, first_and_last, host,
                   context or ParallelGroup(None))


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
