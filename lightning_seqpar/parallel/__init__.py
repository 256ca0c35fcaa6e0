"""Process groups and the ``(pp, dp, tp)`` mesh, the collectives of a group, dropout RNG streams (and their
replay under recomputation), and naming a failed collective. Everything above is built on these."""

from lightning_seqpar.parallel.collectives import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh, validate_layout
from lightning_seqpar.parallel.random import RNGTracker, recomputed

__all__ = ["CommunicationLog", "ParallelGroup", "ParallelMesh", "RNGTracker", "recomputed", "validate_layout"]
