"""The sizes of a parallel layout, validated once, and the named groups they make.

torchtitan's ``ParallelDims`` and Megatron-Core's two ``RankGenerator`` grids as one value: the dense grid
``(tp, cp, dp, pp)`` (fastest first: ``rank = tp_rank + t·(cp_rank + c·(dp_rank + d·pp_rank))``) and the expert grid
``(etp, ep, edp, pp)`` folded over the same ranks (``etp·ep·edp = tp·cp·dp``, "MoE parallel folding"). Without
experts the expert grid is ``etp = t, ep = 1, edp = d·c``: its groups are the dense ones.

Every group the runtime reduces over has a name here (:data:`GROUPS`); a parameter's placement
(:mod:`~lightning_seqpar.parallel.placement`) names the groups it needs, the mesh
(:class:`~lightning_seqpar.parallel.mesh.ParallelMesh`) holds this rank's group of each name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

from lightning_seqpar.parallel.grid import RankGrid

#: Each named group: which grid, and the dimensions its ranks differ along.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("dense", ("tp",)),          # tensor parallel (t)
    "cp": ("dense", ("cp",)),          # context parallel (c)
    "dp": ("dense", ("dp",)),          # data parallel (d): replicas reading different batches
    "pp": ("dense", ("pp",)),          # pipeline parallel (p)
    "dp_cp": ("dense", ("cp", "dp")),  # d·c: where a dense parameter is replicated (Megatron's dp "with cp")
    "etp": ("expert", ("etp",)),       # expert tensor parallel
    "ep": ("expert", ("ep",)),         # expert parallel: ranks holding different experts
    "edp": ("expert", ("edp",)),       # expert data parallel: where an expert's weights are replicated
    "etp_ep": ("expert", ("etp", "ep")),  # the ranks a mixture's tokens are dispatched over (Megatron's tp_ep group)
}


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of one layout over ``world_size`` ranks.

    Attributes:
        world_size: the number of processes.
        tp, cp, pp: tensor-, context- and pipeline-parallel sizes (t, c, p).
        ep: expert-parallel size (experts split over ``ep`` ranks).
        etp: expert tensor-parallel size (``None``: t, Megatron-Core's default).

    Raises:
        ValueError: from :meth:`__post_init__`, one message naming every size and the fix: a size that is not a
            positive integer, a world not divisible by ``tp·cp·pp``, or ``ep·etp`` not dividing ``tp·cp·dp``.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self) -> None:
        check_sizes(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, **({} if self.etp is None else {"etp": self.etp}))
        unit = self.tp * self.cp * self.pp
        if self.world_size % unit:
            names = "tp·pp" if self.cp == 1 else "tp·cp·pp"
            values = f"{self.tp}·{self.pp}" if self.cp == 1 else f"{self.tp}·{self.cp}·{self.pp}"
            raise ValueError(
                f"The world size ({self.world_size} processes) is not divisible by {names} = {values} = {unit}. "
                f"Launch a multiple of {unit} processes (devices × nodes) or change `tp`/`pp`"
                f"{'/`cp`' if self.cp > 1 else ''}.")
        folded = self.expert_tp * self.ep
        if (self.world_size // self.pp) % folded:
            raise ValueError(
                f"The expert grid does not fold over the dense one: ep·etp = {self.ep}·{self.expert_tp} = {folded} "
                f"must divide tp·cp·dp = {self.world_size // self.pp} (world {self.world_size} / pp {self.pp}). "
                f"Choose `ep` and `expert_tp` whose product divides {self.world_size // self.pp}.")

    @property
    def dp(self) -> int:
        """d, the data-parallel size: replicas reading different batches (context-parallel peers excluded)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """The expert data-parallel size: ``world / (etp·ep·pp)``."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @cached_property
    def dense(self) -> RankGrid:
        """The dense grid ``(tp, cp, dp, pp)``, fastest first."""
        return RankGrid((("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp)))

    @cached_property
    def expert(self) -> RankGrid:
        """The expert grid ``(etp, ep, edp, pp)``, fastest first, over the same ranks."""
        return RankGrid((("etp", self.expert_tp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp)))

    def grid(self, name: str) -> RankGrid:
        """The grid group ``name`` is cut from."""
        return self.dense if _entry(name)[0] == "dense" else self.expert

    def size(self, name: str) -> int:
        """The number of ranks of each group ``name``."""
        grid, along = _entry(name)
        out = 1
        for dim in along:
            out *= self.grid(name).size(dim)
        return out

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group ``name``, in Megatron-Core's ``get_ranks`` order."""
        return [list(group) for group in _all_groups(self, name)]

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group ``name`` holding ``rank``."""
        return self.grid(name).group_of(_entry(name)[1], rank)

    def describe(self) -> str:
        """``tp=2 cp=1 pp=1 dp=4 ep=1`` (and the expert grid's other sizes when experts are split over ranks)."""
        text = f"tp={self.tp} cp={self.cp} pp={self.pp} dp={self.dp} ep={self.ep}"
        return text + (f" etp={self.expert_tp} edp={self.edp}" if self.ep > 1 else "")


def check_sizes(**sizes: object) -> None:
    """Each of ``sizes`` (``tp=2, ...``) is a positive integer.

    Raises:
        ValueError: naming the first that is not.
    """
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


@lru_cache(maxsize=256)
def _all_groups(dims: ParallelDims, name: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in dims.grid(name).groups(_entry(name)[1]))


def _entry(name: str) -> tuple[str, tuple[str, ...]]:
    if name not in GROUPS:
        raise KeyError(f"No parallel group named {name!r}; the groups are {sorted(GROUPS)}.")
    return GROUPS[name]
