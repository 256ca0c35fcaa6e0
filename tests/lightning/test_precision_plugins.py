"""Lightning's precision plugins reach the strategy as their shard-aware subclasses."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_seqpar import ParallelMesh, PrecisionConfig, SeqParallelStrategy
from lightning_seqpar.lightning.precision import ShardAwareClipping, shard_aware
from lightning_seqpar.transformer.residual import cast_residual_stream


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


class _Recorder(torch.nn.Module):
    def forward(self, hidden_states, scale=1.0):
        self.seen = hidden_states.dtype
        return hidden_states * scale


def test_the_residual_stream_is_cast_to_autocasts_dtype_only_under_autocast():
    layer = _Recorder()
    handles = cast_residual_stream([layer])
    x = torch.randn(4, 2, 8)
    layer(x)
    assert layer.seen == torch.float32  # outside autocast (32-true, bf16-true) nothing changes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16 and layer.seen == torch.bfloat16
        layer(hidden_states=x, scale=2.0)  # a Hugging Face layer called with keywords
        assert layer.seen == torch.bfloat16
        layer(x.double())
        assert layer.seen == torch.float64  # float64 is never autocast
        handles[0].remove()
        layer(x)
        assert layer.seen == torch.float32


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true"])
def test_a_16_bit_residual_stream_without_autocast_is_refused_at_setup(precision, tmp_path):
    from tests.helpers.models import build, loader, token_data

    strategy = SeqParallelStrategy(precision_config=PrecisionConfig(low_precision_residual=True))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy,
                         precision=precision, logger=False, default_root_dir=tmp_path, max_steps=1)
    try:
        with pytest.raises(ValueError, match=f"needs Trainer\\(precision='bf16-mixed'\\) or '16-mixed'; got precision='{precision}'"):
            trainer.fit(build("gpt"), loader(token_data(1, 1)))
    finally:  # setup had started the one-process group: later tests in this process start their own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_a_16_bit_residual_stream_hooks_every_rewritten_layer_under_autocast():
    from lightning_seqpar.lightning.precision import low_precision_residual
    from lightning_seqpar.transformer.roles import ParallelLayer

    class Layer(ParallelLayer):
        def forward(self, hidden):
            return hidden

    model = torch.nn.Sequential(Layer(), torch.nn.Linear(8, 8), Layer())
    low_precision_residual(model, shard_aware(MixedPrecision("bf16-mixed", "cpu")))
    assert [len(m._forward_pre_hooks) for m in model] == [1, 0, 1]
