"""Tokens dispatched to the experts' ranks and combined back compute what one process computes with every expert:
outputs, and the gradients of the tokens, the router's scores and every expert (an expert no token reaches gets
zeros), in float64; the all-to-alls move exactly the routed pairs that leave a rank; one host read per layer."""

import pytest
import torch
import torch.distributed as dist

from lightning_seqpar.moe import TokenDispatcher
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.collectives import CommunicationLog
from lightning_seqpar.parallel.placement import placement_of
from tests.helpers.distributed import run_distributed
from tests.helpers.moe import E, EMPTY, H, data, local_experts, one_layer_call, reference

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _parallel(rank, world_size, ep):
    groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world_size, ep)]
    group = ParallelGroup(groups[rank // ep])
    group.log = CommunicationLog()
    experts = local_experts(ep, group.rank)
    result = one_layer_call(TokenDispatcher(group, E), experts, rank)
    ids = data(rank)[1]
    result.pop("routing")
    return dict(result, moved=[r.bytes_moved for r in group.log.records if r.kind == "all_to_all_v"],
                leaving=int((ids // (E // ep) != group.rank).sum()),  # pairs whose expert is on another rank
                ep_rank=group.rank, placement=placement_of(experts.gate_up_proj))


@pytest.mark.parametrize("world_size,ep", [(2, 2), (4, 4), (4, 2)], ids=["ep2", "ep4", "ep2-x2"])
def test_dispatch_and_combine_equal_one_process(world_size, ep):
    results = run_distributed(_parallel, world_size, ep)
    local = E // ep
    for start in range(0, world_size, ep):  # each expert-parallel group routes its own ranks' tokens
        ranks = list(range(start, start + ep))
        outs, grads, gate_up, down = reference(ranks)
        arriving = {r: 0 for r in ranks}
        for i, rank in enumerate(ranks):
            got = results[rank]
            torch.testing.assert_close(got["out"], outs[i], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got["x"], grads[i][0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got["scores"], grads[i][1], rtol=1e-12, atol=1e-12)
            mine = slice(got["ep_rank"] * local, (got["ep_rank"] + 1) * local)
            torch.testing.assert_close(got["gate_up"], gate_up[mine], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got["down"], down[mine], rtol=1e-12, atol=1e-12)
            ids = data(rank)[1]
            for other in ranks:
                if other != rank:
                    arriving[other] += int((ids // local == ranks.index(other)).sum())
            assert got["placement"].shard_over == "ep" and got["placement"].replicated_over == "edp"
            assert got["host_reads"] == (0, [ep + E])  # one read of the split sizes: e sends, [e, E/e] receives
        for rank in ranks:  # × h × 8 bytes: the pairs that leave (dispatch, and the combine's backward sending their
            got = results[rank]  # gradients to the experts), the rows that arrived (combine, dispatch's backward)
            row = H * 8
            assert got["moved"] == [got["leaving"] * row, arriving[rank] * row, got["leaving"] * row,
                                    arriving[rank] * row], (rank, got["moved"])
            assert got["leaving"] > 0 and arriving[rank] > 0
        owner = EMPTY // local
        empty = results[ranks[owner]]["gate_up"][EMPTY - owner * local]
        assert empty is not None and torch.count_nonzero(empty) == 0  # no token: zeros, not None
