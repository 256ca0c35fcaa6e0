"""Lightning's precision plugins reach the strategy as their shard-aware subclasses."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_seqpar import ParallelMesh, SeqParallelStrategy
from lightning_seqpar.lightning.precision import ShardAwareClipping, shard_aware


@pytest.mark.parametrize("precision,base", [
    ("32-true", Precision), ("64-true", DoublePrecision), ("bf16-true", HalfPrecision), ("bf16-mixed", MixedPrecision),
])
def test_the_trainers_plugin_becomes_shard_aware_with_the_same_settings(precision, base):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=SeqParallelStrategy(), precision=precision, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ShardAwareClipping) and isinstance(plugin, base)
    assert plugin.precision == precision


def test_clipping_by_norm_uses_the_whole_models_norm():
    plugin = shard_aware(Precision())
    plugin.mesh = ParallelMesh.single()
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    plugin.clip_gradients(torch.optim.SGD([param], lr=0.1), clip_val=1.0)
    torch.testing.assert_close(param.grad, torch.tensor([0.6, 0.8, 0.0, 0.0]), rtol=1e-5, atol=1e-6)


def test_clipping_before_the_mesh_exists_and_unknown_plugins_are_refused():
    with pytest.raises(RuntimeError, match="before SeqParallelStrategy set up its process mesh"):
        shard_aware(None).clip_grad_by_norm(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 1.0)

    class Custom(Precision):
        pass

    with pytest.raises(ValueError, match="add lightning_seqpar.lightning.precision.ShardAwareClipping as the first base class of Custom"):
        SeqParallelStrategy(precision_plugin=Custom())

    class CustomShardAware(ShardAwareClipping, Precision):
        pass

    plugin = CustomShardAware()
    assert SeqParallelStrategy(precision_plugin=plugin).precision_plugin is plugin
