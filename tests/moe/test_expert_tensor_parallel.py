"""Expert tensor parallelism on one process: each expert's width split over etp ranks. The slices' outputs, for the
same rows, add up to the whole expert's (the down projection's bias counted once, gpt-oss's interleaved gating kept
whole) and so do their gradients; the pairs the dispatcher sends number each slice where the etp·ep ranks hold it;
the gating's layout is found by running it; checkpoint pieces of a tensor split twice are contiguous and cover it
once; what cannot split is refused by name. Parity over processes: tests/moe/test_moe_parity.py, test_gpt_oss_parity.py;
resharding: test_moe_resume.py; export: test_moe_hf_directory.py."""

import pytest
import torch

from lightning_seqpar import Layout
from lightning_seqpar.lightning.config import CheckpointConfig, check_together
from lightning_seqpar.moe import GroupedExperts
from lightning_seqpar.moe.dispatch import expert_tensor_parallel_pairs
from lightning_seqpar.moe.experts import glu_layout
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.placement import Placement, ShardSpec, inner_spec, placement_of
from lightning_seqpar.tensor_parallel.sharding import _contiguous_runs, full_shape
from tests.moe.test_experts import _filled, _oss_glu


def _halves_glu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _sliced(whole, etp, rank, **kw):
    """Rank ``rank``'s slice of ``whole``'s experts over ``etp`` ranks (the placement's own split)."""
    part = GroupedExperts(4, 6, 4, expert_tp=etp, etp_rank=rank, dtype=torch.float64, **kw)
    group = ParallelGroup.virtual(etp, rank)
    with torch.no_grad():
        for name, param in part.named_parameters():
            full = getattr(whole, name)
            inner = inner_spec(param)
            param.copy_(inner.shard(full, group) if inner is not None else full)
    return part


@pytest.mark.parametrize("kw", [dict(), dict(transposed=True, bias=True, glu=_oss_glu, interleaved=True)],
                         ids=["halves", "gpt-oss"])
def test_the_width_slices_add_up_to_the_whole_expert_forward_and_backward(kw):
    whole = _filled(GroupedExperts(4, 6, 4, dtype=torch.float64, **kw))
    sizes = [2, 0, 3, 1]
    rows = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = rows.clone().requires_grad_()
    want = whole(x, sizes)
    (want * upstream).sum().backward()
    got, grad_x, parts = 0, 0, []
    for rank in range(2):
        part = _sliced(whole, 2, rank, **kw)
        y = rows.clone().requires_grad_()
        out = part(y, sizes)
        (out * upstream).sum().backward()
        got, grad_x = got + out.detach(), grad_x + y.grad
        parts.append(part)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_x, x.grad, rtol=1e-12, atol=1e-12)
    group = [ParallelGroup.virtual(2, r) for r in range(2)]
    for name, param in whole.named_parameters():
        inner = inner_spec(getattr(parts[0], name))
        if inner is not None:  # each slice's gradient is the whole's gradient of that slice
            for rank in range(2):
                torch.testing.assert_close(getattr(parts[rank], name).grad, inner.shard(param.grad, group[rank]))
        else:  # down_proj_bias: all of it from etp rank 0, zeros from the others (summed over etp: partial_over)
            assert placement_of(getattr(parts[0], name)).partial_over == ("etp",)
            torch.testing.assert_close(parts[0].down_proj_bias.grad + parts[1].down_proj_bias.grad, param.grad)
            assert torch.count_nonzero(parts[1].down_proj_bias.grad) == 0


def test_each_pair_becomes_one_pair_per_slice_numbered_where_the_etp_ep_ranks_hold_it():
    experts = torch.tensor([[0, 5], [7, 2]])  # E 8 over ep 2: experts 0-3 on ep rank 0, 4-7 on ep rank 1
    scores = torch.tensor([[0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)
    ids, weights = expert_tensor_parallel_pairs(experts, scores, 8, 2, 2)
    # slice j of expert x: etp_ep rank j + 2·(x // 4), local expert x % 4 → id rank·4 + x % 4
    assert ids.tolist() == [[0, 4, 9, 13], [11, 15, 2, 6]]
    assert weights.tolist() == [[0.6, 0.6, 0.4, 0.4], [0.9, 0.9, 0.1, 0.1]]
    assert (ids // 4 % 2).tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]  # the etp rank of each slice


def test_the_gating_layout_is_read_by_running_it_and_a_mixing_one_is_refused():
    assert glu_layout(_halves_glu, 4, 2, "layer") == "halves"
    assert glu_layout(_oss_glu, 4, 2, "layer") == "interleaved"
    with pytest.raises(ValueError, match="layer: the experts' gating function makes each of the f outputs from more "
                                         "than its own gate and up value.*expert_tp=2.*Use expert_tp=1"):
        glu_layout(lambda gate_up: _halves_glu(gate_up).flip(-1), 4, 2, "layer")


def test_a_tensor_split_twice_has_its_single_device_shape_and_contiguous_pieces():
    part = GroupedExperts(8, 6, 4, expert_parallel=2, expert_tp=2)
    assert part.gate_up_proj.shape == (4, 4, 6) and full_shape(part.gate_up_proj) == (8, 8, 6)
    assert full_shape(part.down_proj) == (8, 6, 4)
    # gate/up halves of an etp slice: one run per expert, each contiguous in the [4, 4, 6] shard
    runs = _contiguous_runs([4, 2, 0], [4, 2, 6], [0, 2, 0], [4, 4, 6])
    assert [(o, s, at) for o, s, at in runs] == [([4 + e, 2, 0], [1, 2, 6], [e, 2, 0]) for e in range(4)]
    assert _contiguous_runs([0, 0, 2], [4, 6, 2], [0, 0, 0], [4, 6, 2]) == [([0, 0, 2], [4, 6, 2], [0, 0, 0])]


def test_what_cannot_split_twice_is_refused_by_name():
    spec = ShardSpec(dim=0, full_size=8, padded_size=8)
    with pytest.raises(ValueError, match="an inner split needs an outer one"):
        Placement(inner=spec)
    with pytest.raises(ValueError, match="along another dimension, over another group"):
        Placement(shard=spec, shard_over="ep", inner=spec)
    with pytest.raises(ValueError, match="An expert width of 6 does not split over expert_tp=4 ranks"):
        GroupedExperts(4, 8, 6, expert_tp=4)
    with pytest.raises(ValueError, match="zero=1 with expert_tp=2.*Use zero=0, or expert_tp=1"):
        check_together(CheckpointConfig(), Layout(ep=2, expert_tp=2, zero=1))
    check_together(CheckpointConfig(), Layout(ep=2, zero=1))  # whole experts: accepted
