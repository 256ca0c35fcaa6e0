"""Parallel layers built directly draw each rank's shard as its slice of one single-device initialization (Megatron's
``_initialize_affine_weight_cpu``): gathered, the shards are what one device draws with the same seed, and the
shards of different ranks differ."""

import pytest
import torch

from lightning_seqpar import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lightning_seqpar.parallel import ParallelGroup

BUILDERS = {
    "column": lambda group: ColumnParallelLinear(8, 12, group),
    "fused_qkv": lambda group: ColumnParallelLinear(8, 12, group, chunks=3),
    "row": lambda group: RowParallelLinear(12, 8, group),
    "vocabulary": lambda group: VocabParallelEmbedding(13, 8, group),  # 13 rows: padded to 14 at t = 2
}
FULL_SHAPE = {"column": (12, 8), "fused_qkv": (12, 8), "row": (8, 12), "vocabulary": (13, 8)}


# (12 output features in 3 fused blocks split 2 ways only)
@pytest.mark.parametrize("kind, tp", [(k, t) for k in sorted(BUILDERS) for t in (2, 4) if (k, t) != ("fused_qkv", 4)])
def test_gathered_shards_are_the_single_device_draw_and_shards_differ(kind, tp):
    shards = []
    for rank in range(tp):
        torch.manual_seed(0)  # the default generator is seeded alike on every tensor-parallel rank
        shards.append(BUILDERS[kind](ParallelGroup.virtual(tp, rank)).weight.detach())
    torch.manual_seed(0)
    want = torch.empty(FULL_SHAPE[kind]).normal_(std=0.02)
    spec = BUILDERS[kind](ParallelGroup.virtual(tp, 0)).spec
    torch.testing.assert_close(spec.unshard(shards), want, rtol=0, atol=0)
    assert all(not torch.equal(shards[0], other) for other in shards[1:])
