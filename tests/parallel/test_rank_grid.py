"""The dense and the expert grid give every group in Megatron-Core's ``RankGenerator`` order (``tp-cp-ep-dp-pp``;
the expert grid ``etp-ep-edp-pp`` folded over the same ranks). The expected tables are written out by hand from
that order; the 16-rank one is the example of ``initialize_model_parallel``'s docstring."""

import pytest

from lightning_seqpar.parallel.dims import GROUPS, ParallelDims

CASES = {
    "tp2 dp2 pp2, ep2 etp1": (dict(world_size=8, tp=2, pp=2, ep=2, etp=1), {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "etp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    }),
    "tp2 cp2 dp2, ep4 etp1": (dict(world_size=8, tp=2, cp=2, ep=4, etp=1), {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "etp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }),
    "tp2 cp2 dp2, ep2 etp2": (dict(world_size=8, tp=2, cp=2, ep=2, etp=2), {
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "etp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],  # Megatron's tp_ep group: where a mixture's tokens are dispatched
    }),
    "dp4 pp2, ep2": (dict(world_size=8, pp=2, ep=2), {
        "dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    }),
    "tp4 dp2, ep8 etp1": (dict(world_size=8, tp=4, ep=8, etp=1), {
        "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "ep": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "edp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    }),
    "no experts: the expert grid is the dense one": (dict(world_size=8, tp=2, cp=2), {
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }),
    "Megatron's docstring: 16 ranks, tp2 pp4": (dict(world_size=16, tp=2, pp=4), {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    }),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_follow_megatrons_rank_generator(case):
    sizes, expected = CASES[case]
    dims = ParallelDims(**sizes)
    for name, groups in expected.items():
        assert dims.all_groups(name) == groups, name
        assert dims.size(name) == len(groups[0])
        for group in groups:  # the group holding each rank is the same list
            for rank in group:
                assert dims.group_of(name, rank) == group
    # both grids end in the same pipeline groups (Megatron-Core asserts it)
    assert dims.dense.groups(["pp"]) == dims.expert.groups(["pp"])
    for name in GROUPS:  # every group of every name partitions the world
        assert sorted(r for g in dims.all_groups(name) for r in g) == list(range(sizes["world_size"]))


@pytest.mark.parametrize("sizes,message", [
    (dict(world_size=6, tp=4), r"not divisible by tp·pp = 4·1 = 4\. Launch a multiple of 4"),
    (dict(world_size=8, tp=2, cp=3), r"not divisible by tp·cp·pp = 2·3·1 = 6"),
    (dict(world_size=8, tp=2, ep=3), r"ep·etp = 3·2 = 6 must divide tp·cp·dp = 8"),
    (dict(world_size=8, tp=2, pp=2, ep=4), r"ep·etp = 4·2 = 8 must divide tp·cp·dp = 4 \(world 8 / pp 2\)"),
    (dict(world_size=8, ep=0), r"`ep` must be a positive integer, got 0"),
    (dict(world_size=8, etp=True), r"`etp` must be a positive integer, got True"),
])
def test_a_layout_is_refused_once_with_its_sizes_and_the_fix(sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**sizes)


def test_data_parallel_means_data_parallel_only():
    dims = ParallelDims(8, tp=2, cp=2)
    assert (dims.dp, dims.size("dp_cp"), dims.edp) == (2, 4, 4)
    assert dims.describe() == "tp=2 cp=2 pp=1 dp=2 ep=1"
