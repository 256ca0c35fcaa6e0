"""The router losses on one process, against their definitions: the pooled load-balancing loss equals transformers'
``load_balancing_loss_func`` (with and without a padding mask), the per-layer one the sum of each layer's
(Megatron-Core's), the z-loss the sum over layers of ``mean logsumexp(logits)²`` (ST-MoE); float64 logits."""

import pytest
import torch

from lightning_seqpar.models.gpt import GPTConfig
from lightning_seqpar.moe.balancing import load_balancing_loss, router_z_loss

E, K = 8, 2


def _logits():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(10, E, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))


@pytest.mark.parametrize("masked", [False, True])
def test_the_pooled_loss_is_transformers_and_the_per_layer_loss_sums_the_layers(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = _logits()
    mask = torch.ones(2, 5)
    mask[0, 3:] = 0
    mask = mask if masked else None
    torch.testing.assert_close(load_balancing_loss(logits, E, K, mask), load_balancing_loss_func(logits, E, K, mask),
                               rtol=1e-6, atol=0)
    per_layer = load_balancing_loss(logits, E, K, mask, per_layer=True)
    torch.testing.assert_close(per_layer, sum(load_balancing_loss((x,), E, K, mask) for x in logits), rtol=1e-6, atol=0)
    assert abs(float(per_layer) - float(load_balancing_loss(logits, E, K, mask))) > 1e-3  # not the pooled loss


def test_the_z_loss_sums_each_layer_s_mean_squared_log_partition_function():
    logits = _logits()
    want = sum(torch.logsumexp(x, -1).square().mean() for x in logits)
    torch.testing.assert_close(router_z_loss(logits).double(), want, rtol=1e-6, atol=0)
    router_z_loss(logits).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in logits)


def test_an_unknown_aux_loss_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"aux_loss_type='global': 'pooled' \(transformers'\) or 'per_layer'"):
        GPTConfig(n_experts=8, aux_loss_coef=0.1, aux_loss_type="global")


def test_the_pipeline_carrier_reads_the_mask_by_keyword_or_by_position():
    # Every stage reads the 2-D attention_mask from the model's own call, however the caller passed it.
    import torch.nn as nn

    from lightning_seqpar.moe.pipeline_losses import RouterLossTerms, StageRouterLosses

    class Model(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    model, mask = Model(), torch.ones(2, 4)
    carrier = StageRouterLosses(RouterLossTerms(4, 2, pooled=0.5), {}, 1)
    model.register_forward_pre_hook(carrier.capture, with_kwargs=True)
    model(torch.zeros(2, 4), attention_mask=mask)
    assert carrier.attention_mask is mask
    model(torch.zeros(2, 4), mask)
    assert carrier.attention_mask is mask
    model(torch.zeros(2, 4))
    assert carrier.attention_mask is None
