"""One rank's process groups, one per name of :data:`~lightning_seqpar.parallel.dims.GROUPS`, built from a
:class:`~lightning_seqpar.parallel.dims.ParallelDims`.

The dense grid orders ranks as Megatron-LM does, tensor-parallel ranks fastest, context-parallel next:
``rank = tp_rank + t · (cp_rank + c · (dp_rank + d · pp_rank))``; the expert grid ``(etp, ep, edp, pp)`` folds over
the same ranks. Parameters are replicated over context-parallel ranks as over data-parallel ones, and their gradients
are reduced over both together (the ``dp_cp`` group, Megatron-LM's data-parallel group "with context parallel").
Which group reduces a parameter's gradient is the parameter's placement's to say
(:mod:`~lightning_seqpar.parallel.placement`); the mesh only holds the groups by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.dims import GROUPS, ParallelDims
from lightning_seqpar.parallel.placement import ShardGrid, placement_of


def validate_layout(world_size: int, tp: int, pp: int, cp: int = 1) -> ParallelDims:
    """The :class:`~lightning_seqpar.parallel.dims.ParallelDims` of ``world_size`` processes split ``tp·cp·pp``
    ways (``dims.dp``: the data-parallel size d).

    Raises:
        ValueError: if ``tp``, ``pp`` or ``cp`` is not a positive integer, or ``world_size`` is not
            divisible by ``tp · cp · pp``. Called before any collective, so no process hangs.
    """
    return ParallelDims(world_size, tp=tp, pp=pp, cp=cp)


@dataclass(frozen=True)
class ParallelMesh:
    """Process groups of one rank, by name (``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``, ``"dp_cp"``, ``"etp"``, ``"ep"``,
    ``"edp"``; :data:`~lightning_seqpar.parallel.dims.GROUPS`): the one source of its ranks and sizes.

    Attributes:
        groups: this rank's group of each name; a name left out is a group of one rank.
        dims: the layout the groups were cut from (``None`` for a mesh of given groups: one process, planning).
        first_and_last: for ``p > 2``, the group of the first and the last pipeline stage of this rank's
            ``(data, tensor)`` coordinate when this rank is one of them (:attr:`embedding`).
        host_groups: gloo twins of every group, ``{"dp_cp": ..., "embedding": ...}``, when the default backend is not
            gloo (NCCL): flags the host already knows (which parameters got a gradient) are exchanged on them in host
            memory, with no device synchronization (Megatron-LM's ``get_data_parallel_group_gloo``). Empty under
            gloo, whose groups serve as they are.
    """

    groups: Mapping[str, ParallelGroup] = field(default_factory=dict)
    dims: Optional[ParallelDims] = None
    first_and_last: Optional[ParallelGroup] = None
    host_groups: Mapping[str, ParallelGroup] = field(default_factory=dict)
    _device_meshes: dict = field(default_factory=dict, compare=False, repr=False)
    _representatives: dict = field(default_factory=dict, compare=False, repr=False)

    def group(self, name: str) -> ParallelGroup:
        """This rank's group ``name`` (``"embedding"``: :attr:`embedding`).

        Raises:
            KeyError: a name that is not a group of the mesh.
        """
        if name == "embedding":
            return self.embedding
        if name not in GROUPS:
            raise KeyError(f"No parallel group named {name!r}; the groups are {sorted(GROUPS)} and 'embedding'.")
        return self.groups.get(name, _ONE)

    @property
    def tensor(self) -> ParallelGroup:
        """The tensor-parallel group (size t)."""
        return self.group("tp")

    @property
    def data(self) -> ParallelGroup:
        """The group over which dense parameters are replicated: the data-parallel ranks and, under context
        parallelism, their context-parallel ranks (size ``d · c``; rank ``dp_rank · c + cp_rank``)."""
        return self.group("dp_cp")

    @property
    def replicas(self) -> int:
        """The number of data replicas (d·c) a summed gradient is divided by, whichever group summed it."""
        return self.data.size

    @property
    def pipeline(self) -> ParallelGroup:
        """The pipeline-parallel group (size p)."""
        return self.group("pp")

    @property
    def context(self) -> ParallelGroup:
        """The context-parallel group (size c): ranks holding other tokens of the same sequences, inside ``data``."""
        return self.group("cp")

    @property
    def embedding(self) -> ParallelGroup:
        """The first and the last pipeline stage of this rank's pipeline (Megatron-LM's embedding group): where
        the gradients of a tied embedding and LM head are summed. The pipeline group itself when ``p <= 2``; a
        group of one rank on middle stages (they hold no such parameter)."""
        if self.pipeline.size <= 2:
            return self.pipeline
        return self.first_and_last if self.first_and_last is not None else ParallelGroup(None)

    def host(self, name: str) -> ParallelGroup:
        """The group ``name`` (any of :meth:`group`'s names; ``"data"`` and ``"pipeline"`` are ``"dp_cp"`` and
        ``"pp"``) for exchanging host-side values: CPU tensors, reduced without touching the device
        (:attr:`host_groups`)."""
        name = {"data": "dp_cp", "pipeline": "pp"}.get(name, name)
        if name in self.host_groups:
            return self.host_groups[name]
        return self.group(name)

    def size(self, name: str) -> int:
        """The number of ranks of group ``name``."""
        return self.group(name).size

    def same_group(self, a: str, b: str) -> bool:
        """Whether groups ``a`` and ``b`` hold the same ranks (one collective over either serves both)."""
        if self.dims is not None and a in GROUPS and b in GROUPS:
            return self.dims.all_groups(a) == self.dims.all_groups(b)
        return self.group(a) is self.group(b) or self.group(a).size == self.group(b).size == 1

    def representative(self, name: str) -> Optional[str]:
        """The first name, in :data:`~lightning_seqpar.parallel.dims.GROUPS` order, of a group holding the same ranks
        as group ``name`` (one collective over it serves every such name); ``None`` for a group of one rank, over
        which nothing is reduced. Worked out once per mesh."""
        if not self._representatives:
            kept: list[str] = []
            for candidate in GROUPS:
                if self.size(candidate) == 1:
                    self._representatives[candidate] = None
                    continue
                same = next((k for k in kept if self.same_group(candidate, k)), None)
                if same is None:
                    kept.append(candidate)
                self._representatives[candidate] = same or candidate
        return self._representatives[name]

    def ranks_of(self, rows: str, columns: str) -> tuple[tuple[int, ...], ...]:
        """Global ranks ``[i][j]`` at rank ``i`` of group ``rows`` and rank ``j`` of group ``columns``, this rank's other
        coordinates fixed (the two groups must be cut from the same grid).

        Raises:
            ValueError: a mesh without :attr:`dims` (given groups), where no rank table exists.
        """
        if self.dims is None:
            raise ValueError("A mesh of given groups has no rank table; build it with ParallelMesh.build.")
        if self.dims.grid(rows) is not self.dims.grid(columns):
            raise ValueError(f"Groups {rows!r} and {columns!r} are cut from different grids.")
        return tuple(tuple(self.dims.group_of(columns, r)) for r in self.dims.group_of(rows, dist.get_rank()))

    def device_mesh(self, name: str) -> Optional[Any]:
        """A one-dimensional ``torch.distributed.DeviceMesh`` over group ``name`` (for DTensor views of shards in
        checkpoints); ``None`` for a group of one rank."""
        group = self.group(name)
        if group.size == 1 or group.group is None:
            return None
        if name not in self._device_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            device_type = "cuda" if dist.get_backend(group.group) == "nccl" else "cpu"
            self._device_meshes[name] = DeviceMesh.from_group(group.group, device_type, mesh_dim_names=(name,))
        return self._device_meshes[name]

    def shard_device_mesh(self, param: Any) -> Optional[Any]:
        """:meth:`device_mesh` of the group ``param``'s shard is split over (its placement's ``shard_over``); ``None``
        for a parameter that is not split; for one split twice (``inner``), the
        :class:`~lightning_seqpar.parallel.placement.ShardGrid` of both groups."""
        placement = placement_of(param)
        if placement.shard is None:
            return None
        if placement.inner is not None:
            return ShardGrid(self.ranks_of(placement.shard_over, placement.inner_over),
                             self.group(placement.shard_over).rank, self.group(placement.inner_over).rank)
        return self.device_mesh(placement.shard_over)

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

    def sum_over_batches(self, counts: Tensor) -> Tensor:
        """``counts`` (of this rank's batch) summed over the d data-parallel batches: the sum over ``data`` (d·c
        ranks) divided by c, since context-parallel peers hold the same batch. One all-reduce; a new tensor."""
        if self.data.size == 1:
            return counts.clone()
        return self.data.all_reduce(counts.clone()) / self.context.size

    @property
    def leads_replica(self) -> bool:
        """Whether this rank is its replica's first (tensor- and pipeline-parallel rank 0): where work done once per
        replica is done, then :meth:`share_within_replica`."""
        return self.tensor.rank == 0 and self.pipeline.rank == 0

    def share_within_replica(self, values: Tensor) -> Tensor:
        """The replica's first rank's ``values`` on every rank of the replica, in place: broadcast over tp (the first
        stage's groups carry it; the others' are overwritten next), then over pp from the first stage."""
        self.tensor.broadcast(values, 0)
        self.pipeline.broadcast(values, 0)
        return values

    @property
    def pp(self) -> int:
        """p, the pipeline-parallel size."""
        return self.pipeline.size

    @classmethod
    def single(cls) -> "ParallelMesh":
        """The mesh of an unparallelized run: every group has one rank."""
        return cls()

    @classmethod
    def virtual(cls, dims: ParallelDims, rank: int = 0) -> "ParallelMesh":
        """The mesh global rank ``rank`` of ``dims`` would hold, with no process group behind it: each named group
        virtual (:meth:`~lightning_seqpar.parallel.collectives.ParallelGroup.virtual`, its collectives raise), of the
        size ``dims`` gives and at ``rank``'s place in it. What a plan, a dry run or a check builds a rank with.

        Raises:
            ValueError: ``rank`` outside ``0 .. dims.world_size - 1``.
        """
        if not 0 <= rank < dims.world_size:
            raise ValueError(f"rank={rank} is not a rank of a world of {dims.world_size}.")
        groups = {name: ParallelGroup.virtual(dims.size(name), dims.group_of(name, rank).index(rank))
                  for name in GROUPS}
        return cls(groups, dims)

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, device_type: str = "cpu", host_groups: Optional[bool] = None,
              timeout: Optional[timedelta] = None, cp: int = 1, dims: Optional[ParallelDims] = None
              ) -> "ParallelMesh":
        """Build every group of :data:`~lightning_seqpar.parallel.dims.GROUPS` over the initialized default process
        group: every rank creates every group, in the same order (``torch.distributed.new_group``'s rule); groups of
        two names with the same ranks are one process group.

        ``dims``: the validated layout (default: ``tp``, ``pp``, ``cp`` over the world, validated here).
        ``host_groups``: create the gloo twins of :attr:`host_groups` (default: when the backend is not gloo).
        ``timeout``: how long every group's collectives wait for a peer (default: torch's); the same for
        all of them, so a stalled peer ends the job after the strategy's timeout whichever group it stalls.
        ``device_type``: kept for callers; groups take the default backend.

        Raises:
            ValueError: from :class:`~lightning_seqpar.parallel.dims.ParallelDims`.
            RuntimeError: if ``torch.distributed`` is not initialized.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs an initialized torch.distributed process group.")
        if dims is None:
            dims = validate_layout(dist.get_world_size(), tp, pp, cp)
        elif dims.world_size != dist.get_world_size():
            raise ValueError(f"The layout {dims.describe()} is for {dims.world_size} processes; this world has "
                             f"{dist.get_world_size()}.")
        factory = _GroupFactory(timeout)
        groups = {name: factory.mine(dims.all_groups(name), None, f"mesh_{name}") for name in GROUPS}
        world = dims.world_size
        stages = [[c, c + (dims.pp - 1) * (world // dims.pp)] for c in range(world // dims.pp)]
        first_and_last = factory.mine(stages, None, "first_and_last_stage") if dims.pp > 2 else None
        if host_groups is None:
            # torch's fake backend (one rank of a large world, no communication: the memory check) has no gloo
            host_groups = dist.get_backend() not in ("gloo", "fake")
        host: dict[str, ParallelGroup] = {}
        if host_groups:
            host = {name: factory.mine(dims.all_groups(name), "gloo", f"host_{name}") for name in GROUPS}
            if dims.pp > 2:
                host["embedding"] = factory.mine(stages, "gloo", "host_first_and_last_stage") or ParallelGroup(None)
            elif dims.pp == 2:
                host["embedding"] = host["pp"]
        return cls({k: v for k, v in groups.items() if v is not None}, dims, first_and_last,
                   {k: v for k, v in host.items() if v is not None})


_ONE = ParallelGroup(None)


class _GroupFactory:
    """Creates process groups, once per distinct ``(ranks, backend)``: every rank sees the same calls in the same
    order, so each group is created by all ranks together."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self.timeout = timeout
        self._made: dict[tuple[tuple[int, ...], Optional[str]], Any] = {}

    def mine(self, all_ranks: list[list[int]], backend: Optional[str], description: str) -> Optional[ParallelGroup]:
        """This rank's group among ``all_ranks`` (creating those not made yet), or ``None`` if it is in none. Each
        name gets its own :class:`ParallelGroup` (its own communication log) over the shared process group."""
        rank, mine = dist.get_rank(), None
        for ranks in all_ranks:
            key = (tuple(ranks), backend)
            if key not in self._made:
                self._made[key] = dist.new_group(ranks, backend=backend, timeout=self.timeout, group_desc=description)
            if rank in ranks:
                mine = ParallelGroup(self._made[key])
        return mine
