"""Mixture-of-experts building blocks under expert parallelism: the token dispatch and combine over the
expert-parallel group (:mod:`.dispatch`) and a rank's share of the experts (:mod:`.experts`)."""

from lightning_seqpar.moe.dispatch import Dispatched, TokenDispatcher, all_to_all_v
from lightning_seqpar.moe.experts import GroupedExperts

__all__ = ["Dispatched", "GroupedExperts", "TokenDispatcher", "all_to_all_v"]
