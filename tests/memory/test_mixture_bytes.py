"""A mixture of experts' layer: the bytes it keeps on the device and moves to the host equal the memory model's
(:mod:`lightning_seqpar.memory.mixture`), to the byte, at tp 2 with SP, over ep 2 and over expert_tp 2, for every
recomputation and offload choice the experts add and their pairs with the dense ones; the routing's R is the one the
layer received (the model takes it), the rest is a pure function of the shape."""

from __future__ import annotations

import pytest
import torch

from tests.memory.test_mixture_model import CHOICES, GRIDS, SHAPE
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _world(rank: int, world: int) -> list[tuple[float, float, float, float]]:
    from lightning_seqpar.parallel import ParallelGroup
    from recipes.benchmarking.measure import measure_gpt_layer

    group = ParallelGroup(torch.distributed.group.WORLD)
    out = []
    for mixture in GRIDS.values():
        for modules, offload in CHOICES:
            m = measure_gpt_layer(SHAPE, group, True, "none", modules=modules, offload=offload,
                                  norm_statistics_bytes=2, experts=mixture, expert_group=group)
            out.append((m.measured_bytes, m.model_bytes, m.offloaded_bytes, m.model_offloaded))
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_world, 2)


@pytest.mark.parametrize("grid", list(GRIDS))
def test_a_mixture_s_bytes_on_the_device_and_moved_equal_the_model_for_every_choice(measured, grid):
    start = list(GRIDS).index(grid) * len(CHOICES)
    for rank, results in enumerate(measured):
        for (modules, offload), (device, model, moved, model_moved) in zip(CHOICES, results[start:]):
            assert device == model, (rank, modules, offload)
            assert moved == model_moved and (moved > 0) == bool(offload), (rank, modules, offload)
