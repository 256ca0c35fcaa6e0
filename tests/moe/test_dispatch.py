"""Tokens dispatched to the experts' ranks and combined back compute what one process computes with every expert:
outputs, and the gradients of the tokens, the router's scores and every expert (an expert no token reaches gets
zeros), in float64; the all-to-alls move exactly the routed pairs that leave a rank; one host read per layer. Under
expert tensor parallelism (ep 2 × expert_tp 2) each pair goes to both halves of its expert's width, and the halves'
outputs add up to the expert's."""

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


def _width_split(rank, world_size):
    """Rank ``rank`` of ep 2 × expert_tp 2 (etp fastest): its experts' half widths, each pair sent to both halves."""
    from lightning_seqpar.moe.dispatch import expert_tensor_parallel_pairs
    from lightning_seqpar.moe import GroupedExperts
    from tests.helpers.moe import F_, weights

    group = ParallelGroup(dist.new_group(list(range(world_size))))  # the etp_ep group: 4 ranks
    group.log = CommunicationLog()
    etp_rank, ep_rank = rank % 2, rank // 2
    experts = GroupedExperts(E, H, F_, expert_parallel=2, expert_tp=2, etp_rank=etp_rank).double()
    local = E // 2
    with torch.no_grad():
        for mine, full in zip((experts.gate_up_proj, experts.down_proj), weights()):
            spec = placement_of(mine).inner
            mine.copy_(spec.shard(full[ep_rank * local:(ep_rank + 1) * local], ParallelGroup.virtual(2, etp_rank)))
    x, ids, scores, upstream = data(rank)
    x.requires_grad_()
    scores.requires_grad_()
    slices, weights_of = expert_tensor_parallel_pairs(ids, scores, E, 2, 2)
    dispatcher = TokenDispatcher(group, 2 * E)
    rows, routing = dispatcher.dispatch(x, slices, weights_of)
    out = dispatcher.combine(experts(rows, routing.tokens_per_expert, routing.expert_counts), routing, weights_of)
    (out * upstream).sum().backward()
    return dict(out=out.detach(), x=x.grad, scores=scores.grad, gate_up=experts.gate_up_proj.grad,
                down=experts.down_proj.grad, moved=[r.bytes_moved for r in group.log.records if r.kind == "all_to_all_v"],
                leaving=int((slices // local != rank).sum()))


def test_expert_tensor_parallel_dispatch_equals_one_process_and_moves_every_slice_pair_that_leaves():
    results = run_distributed(_width_split, 4)
    outs, grads, gate_up, down = reference([0, 1, 2, 3])
    local = E // 2
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["out"], outs[rank], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x"], grads[rank][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["scores"], grads[rank][1], rtol=1e-12, atol=1e-12)
        ep_rank, etp_rank = rank // 2, rank % 2
        mine = slice(ep_rank * local, (ep_rank + 1) * local)
        want_gate_up = torch.cat([g.chunk(2, dim=1)[etp_rank] for g in gate_up[mine].chunk(2, dim=1)], dim=1)
        torch.testing.assert_close(got["gate_up"], want_gate_up, rtol=1e-12, atol=1e-12)  # its f/2 of gate and of up
        torch.testing.assert_close(got["down"], down[mine].chunk(2, dim=2)[etp_rank], rtol=1e-12, atol=1e-12)
        assert got["leaving"] > 0
        assert got["moved"][0] == got["moved"][2] == got["leaving"] * H * 8  # K·etp slice pairs, those that leave
