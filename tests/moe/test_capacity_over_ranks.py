"""Dispatch with an expert capacity over 2 and 4 expert-parallel gloo processes: each rank's pairs are capped per
expert as on one process (outputs and every gradient equal the token-by-token reference of test_capacity.py, float64),
nothing is read on the host, and each all-to-all moves the fixed ``(e−1)·E/e·C·h`` elements whatever the routing."""

import pytest
import torch.distributed as dist

from lightning_seqpar.moe import DispatchConfig, expert_capacity
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.collectives import CommunicationLog
from tests.helpers.distributed import run_distributed
from tests.helpers.moe import E, H, K, N
from tests.moe.test_capacity import _assert_equal, _run, capacity_reference

pytestmark = pytest.mark.distributed


def _parallel(rank, world_size, ep, policy):
    groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world_size, ep)]
    group = ParallelGroup(groups[rank // ep])
    group.log = CommunicationLog()
    result = _run(group, rank, ep, DispatchConfig(0.5, policy))
    result["moved"] = [r.bytes_moved for r in group.log.records if r.kind == "all_to_all_v"]
    return result


@pytest.mark.parametrize("world_size, ep, policy", [(2, 2, "probs"), (4, 4, "position")])
def test_over_expert_parallel_ranks_each_rank_s_pairs_are_capped_as_on_one_process(world_size, ep, policy):
    results = run_distributed(_parallel, world_size, ep, policy)
    capacity, local = expert_capacity(N, K, E, 0.5), E // ep
    ranks = list(range(world_size))
    outs, grads, gate_up, down, dropped = capacity_reference(ranks, capacity, policy)
    assert min(dropped) > 0
    for i, rank in enumerate(ranks):
        got = results[rank]
        mine = slice(got["ep_rank"] * local, (got["ep_rank"] + 1) * local)
        _assert_equal(got, outs[i], grads[i], gate_up, down, mine)
        assert got["host_reads"] == (0, [])  # fixed sizes: nothing read on the host
        sent = (ep - 1) * local * capacity * H * 8  # each other rank's E/e experts' C rows, float64
        assert got["moved"] == [sent] * 4  # dispatch, combine, and their backwards
