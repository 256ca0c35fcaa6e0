"""Muon over ZeRO-1's element ranges: what :class:`~lightning_seqpar.optim.DistributedOptimizer` steps for a Muon.

Under ``zero=1`` each data-parallel rank updates a flat range of every parameter. Muon's momentum and AdamW's moments
are element-wise, so they live on the ranges; the orthogonalisation reads whole matrices, so each matrix's ranges are
brought to one owner of its data-parallel group (:mod:`~lightning_seqpar.optim.range_owners`; owners from the shapes,
the same on the owner's tensor-parallel peers, which therefore own the same matrices), orthogonalised there over the
matrix's tensor-parallel split (:func:`~lightning_seqpar.optim.sharded_muon.orthogonalised`), and the result's ranges
sent back. Each matrix is orthogonalised once in the whole tp × dp group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.optim.matrix_owners import Matrix, owners
from lightning_seqpar.optim.muon import Muon
from lightning_seqpar.optim.range_owners import gather_ranges, scatter_ranges
from lightning_seqpar.optim.sharded_muon import matrix_split, orthogonalised
from lightning_seqpar.parallel.mesh import ParallelMesh


class RangeMuon(Muon):
    """:class:`~lightning_seqpar.optim.Muon` whose "parameters" are this rank's flat element ranges.

    Args:
        groups: the ranges' param groups, each with every setting (``use_muon`` included).
        ranges: each range's ``id`` → its parameter and the name of the data-parallel group its ranges split over.
        mesh: the process groups.

    Raises:
        ValueError: a range of a parameter of fewer than two dims in a ``use_muon`` group, or a matrix split along
            both of its dims.
    """

    def __init__(self, groups: list[dict[str, Any]], ranges: dict[int, tuple[nn.Parameter, str]],
                 mesh: ParallelMesh) -> None:
        self._ranges = dict(ranges)  # (read by the constructor's check, through _matrix_of)
        super().__init__(groups)
        self.place(mesh)

    def _matrix_of(self, held: Tensor) -> Tensor:
        return self._ranges[id(held)][0]

    def place(self, mesh: Any) -> None:
        self.mesh = mesh
        self._splits = {id(param): matrix_split(param, mesh) for param, _ in self._ranges.values()}

    def _orthogonalised(self, entries: list[tuple[Tensor, Tensor, tuple]]) -> list[Tensor]:
        """The orthogonalised update of each range of ``entries`` (see the module). Collective: every data-parallel
        group in its name's order, each way, and the tensor-parallel exchanges between."""
        by_group: dict[str, list[int]] = {}
        for k, (piece, _, _) in enumerate(entries):
            by_group.setdefault(self._ranges[id(piece)][1], []).append(k)
        owned: dict[int, Tensor] = {}
        plans = {}
        for name in sorted(by_group):
            ks, group = by_group[name], self.mesh.group(name)
            params = [self._matrix_of(entries[k][0]) for k in ks]
            owner = owners([Matrix(p.detach(), None) for p in params], group.size)
            plans[name] = (ks, group, params, owner)
            got = gather_ranges([entries[k][1] for k in ks], [p.numel() for p in params], group, owner,
                                torch.bfloat16)
            owned.update({ks[j]: whole.view(params[j].shape) for j, whole in got.items()})
        mine = sorted(owned)
        results = dict(zip(mine, orthogonalised([(self._matrix_of(entries[k][0]), owned[k], entries[k][2])
                                                 for k in mine], self._splits, self.mesh, self._count)))
        out: list[Tensor] = [torch.empty(0)] * len(entries)
        for name in sorted(plans):
            ks, group, params, owner = plans[name]
            back = scatter_ranges({j: results[k] for j, k in enumerate(ks) if k in results},
                                  [p.numel() for p in params], group, owner, torch.bfloat16, entries[0][0].device)
            for k, piece in zip(ks, back):
                out[k] = piece
        return out
