"""Process groups, the mesh (a dense ``(tp, cp, dp, pp)`` grid and an expert ``(etp, ep, edp, pp)`` grid, groups by name)
and each parameter's placement over it, the collectives of a group, dropout RNG streams (and their
replay under recomputation), and naming a failed collective. Everything above is built on these."""

from lightning_seqpar.parallel.collectives import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.dims import ParallelDims
from lightning_seqpar.parallel.mesh import ParallelMesh, validate_layout
from lightning_seqpar.parallel.placement import Placement, placement_of
from lightning_seqpar.parallel.random import RNGTracker, recomputed

__all__ = ["CommunicationLog", "ParallelDims", "ParallelGroup", "ParallelMesh", "Placement", "RNGTracker", "placement_of",
           "recomputed", "validate_layout"]
