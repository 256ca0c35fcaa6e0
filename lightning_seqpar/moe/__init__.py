"""Mixture-of-experts building blocks under expert parallelism: the token dispatch and combine over the
expert-parallel group (:mod:`.dispatch`), a rank's share of the experts (:mod:`.experts`) and the load-balancing loss
over every rank's tokens (:mod:`.balancing`); dispatch with an expert capacity (:mod:`.capacity`)."""

from lightning_seqpar.moe.balancing import RouterTokens, load_balancing_loss, parallel_load_balancing_loss
from lightning_seqpar.moe.capacity import CapacityDispatcher, expert_capacity
from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.moe.dispatch import Dispatched, TokenDispatcher, all_to_all_v
from lightning_seqpar.moe.experts import GroupedExperts

__all__ = ["CapacityDispatcher", "DispatchConfig", "Dispatched", "expert_capacity", "GroupedExperts", "RouterTokens", "TokenDispatcher", "all_to_all_v", "load_balancing_loss",
           "parallel_load_balancing_loss"]
