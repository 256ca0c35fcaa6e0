"""Muon's step in the planner (:mod:`lightning_seqpar.plan.pricing.muon_cost`): Newton–Schulz FLOPs and the bytes a rank
sends, against counts made by hand and the exchange's own formula."""

from __future__ import annotations

import torch

from lightning_seqpar.optim.matrix_owners import Matrix, exchange_bytes
from lightning_seqpar.parallel.placement import ShardSpec
from lightning_seqpar.plan.pricing.model_inventory import ParameterEntry
from lightning_seqpar.plan.pricing.muon_cost import muon_step_cost, newton_schulz_flops


def test_newton_schulz_flops_count_the_three_products_of_each_iteration():
    # [2, 3]: X·Xᵀ 2·2·2·3 = 24, A·A 2·8 = 16, B·X 24; five iterations
    assert newton_schulz_flops(2, 3) == 5 * (24 + 16 + 24)
    assert newton_schulz_flops(3, 2) == newton_schulz_flops(2, 3)  # orthogonalised along the shorter side


def test_a_rank_s_share_of_flops_and_bytes():
    column = ParameterEntry("layers.0.q.weight", (8, 4), "column", "layer", 0)
    router = ParameterEntry("layers.0.gate.weight", (6, 4), "replicated", "layer", 0)
    experts = ParameterEntry("layers.0.experts.up", (6, 8, 4), "expert_width", "layer", 0)
    norm = ParameterEntry("layers.0.norm.weight", (4,), "replicated", "layer", 0)
    head = ParameterEntry("lm_head.weight", (10, 4), "vocab", "head")
    t, ep, etp = 2, 3, 2
    flops, sent = muon_step_cost([column, router, experts, norm, head], t, ep, etp)
    assert flops == (newton_schulz_flops(8, 4) / t + newton_schulz_flops(6, 4) / t
                     + (6 // ep) * newton_schulz_flops(8, 4) / etp)
    # the exchange's bytes over a group, per rank: a split matrix's pieces there and back, a replicated one's back
    dense = exchange_bytes([Matrix(torch.empty(4, 4), ShardSpec(0, 8, 8)), Matrix(torch.empty(6, 4), None)], t, 2)
    expert = exchange_bytes([Matrix(torch.empty(2, 4, 4), ShardSpec(1, 8, 8))], etp, 2)
    assert sent == dense / t + expert / etp


def test_under_zero_1_a_rank_runs_its_share_of_its_data_parallel_group_s_orthogonalisations():
    column = ParameterEntry("layers.0.q.weight", (8, 4), "column", "layer", 0)
    t, d = 2, 4
    flops, sent = muon_step_cost([column], t, data=d)
    assert flops == newton_schulz_flops(8, 4) / (t * d)
    shard = 8 * 4 // t  # this rank's tensor-parallel shard; its 1/d range to the owner and the result's back
    tensor_parallel = exchange_bytes([Matrix(torch.empty(4, 4), ShardSpec(0, 8, 8))], t, 2) / t
    assert sent == tensor_parallel / d + 2 * (d - 1) * shard / d ** 2 * 2
