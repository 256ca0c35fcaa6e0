"""After 20 AdamW steps of a mixture of experts at tp 2 × ep 2 over 4 ranks (dp 2): every replica of a tensor holds
the same bits. The router, replicated on all four ranks, each routing its own tokens; each expert and its optimizer
state (``exp_avg``, ``exp_avg_sq``) on its two expert-data-parallel replicas (an expert that receives no token in a
step gets a zero gradient, not ``None``, so AdamW moves its state alike on every replica)."""

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import fit
from tests.moe.test_moe_parity import moe

pytestmark = pytest.mark.distributed

STEPS = 20


class _Final(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        mesh = trainer.strategy.mesh
        optimizer = trainer.optimizers[0]
        self.where = {"tp": mesh.tensor.rank, "ep": mesh.group("ep").rank, "edp": mesh.group("edp").rank}
        self.routers = {n: p.detach().clone() for n, p in pl_module.named_parameters() if n.endswith("mlp.gate.weight")}
        self.experts = {n: (p.detach().clone(), *(optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")))
                        for n, p in pl_module.named_parameters() if ".experts." in n}


def _train(rank, world_size):
    final = _Final()
    fit(moe("qwen3_moe", 2, 2), world_size, steps=STEPS, callbacks=[final])
    return final.where, final.routers, final.experts


def test_router_and_expert_replicas_stay_bitwise_equal():
    ranks = run_distributed(_train, 4)
    routers = [r[1] for r in ranks]
    assert routers[0] and all(torch.equal(t, other[n]) for other in routers[1:] for n, t in routers[0].items())
    by_shard = {}
    for where, _, experts in ranks:
        by_shard.setdefault(where["ep"], []).append((where["edp"], experts))
    for shard, replicas in by_shard.items():
        assert sorted(edp for edp, _ in replicas) == [0, 1], (shard, replicas)
        (_, first), (_, second) = replicas
        for name, tensors in first.items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, second[name])), (shard, name)
    assert not torch.equal(*(by_shard[s][0][1]["model.model.layers.0.mlp.experts.down_proj"][0] for s in (0, 1)))
