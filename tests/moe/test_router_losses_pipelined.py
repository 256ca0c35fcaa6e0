"""Router losses split into pipeline stages train like one process: transformers' load-balancing loss pooled over
every layer (the earlier stages' statistics travel with the activation, the totals come back with its gradient),
the reference GPT's pooled and per-layer losses and its z-loss, under 1F1B, interleaved, ZB-H1, ZB-V and DualPipeV, with padding
left out of the counts; float64, the loss and every gradient before each of 3 AdamW steps (router, experts, attention).
Under ZB-H1 the experts' weight gradients come in W (moe/expert_product.py) as the linears' do."""

import pytest
import torch

from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, relative_error_below, world_runs

pytestmark = pytest.mark.distributed

INTERLEAVED = (("virtual_stages", 2),)
ZB_H1 = (("schedule", "ZB-H1"),)
ZB_V = (("schedule", "ZB-V"),)


def gpt(tp, ep, pipeline=(), layers=2, accumulate=1, recompute=None, cp=1, **losses):
    """The reference GPT with 8 experts per layer at pp 2 (2 micro-batches of 1 sample), its router losses as
    ``losses`` say; the reference computes them over each micro-batch's tokens, as the pipeline does."""
    trainer = (("accumulate_grad_batches", accumulate),) if accumulate > 1 else ()
    return Case("gpt", tp, True, recompute, (("n_experts", 8), ("n_layer", layers), *losses.items()), trainer,
                (("ep", ep), ("num_microbatches", 2), *pipeline), pp=2, batch=2, microbatches=2, cp=cp)


def hf(tp, ep, pipeline=(), **model):
    """A Hugging Face Qwen3-MoE at pp 2 with transformers' pooled load-balancing loss (coefficient 0.5)."""
    return Case("hf", tp, True, None, (("family", "qwen3_moe"), ("labels", True), ("aux", 0.5), *model.items()), (),
                (("ep", ep), ("num_microbatches", 2), *pipeline), pp=2, batch=2, microbatches=2)


CASES = {
    4: [
        gpt(1, 2, aux_loss_coef=0.5),                                 # pooled over both stages' layers, ep over dp
        gpt(2, 2, aux_loss_coef=0.5, aux_loss_type="per_layer", z_loss_coef=0.1),  # tp 2 × pp 2: per layer, z
        gpt(1, 2, INTERLEAVED, layers=4, aux_loss_coef=0.5, z_loss_coef=0.1),  # two chunks per rank
        gpt(1, 2, ZB_H1, aux_loss_coef=0.5, accumulate=2),            # B/W split, accumulated: scaled as the loss
        hf(1, 2),                                                     # transformers' pooled loss
        hf(2, 2, padding=True),                                       # padding left out of every stage's counts
        gpt(1, 2, recompute="full", aux_loss_coef=0.5, z_loss_coef=0.1),  # a layer's forward again in backward
        gpt(1, 2, cp=2, aux_loss_coef=0.5, z_loss_coef=0.1),          # cp 2: each stage's share times c, as the loss
        hf(2, 2, ZB_H1),                                              # the experts' weight gradients in W too
        gpt(1, 2, ZB_V, layers=4, aux_loss_coef=0.5, z_loss_coef=0.1),  # V: the last stage on rank 0, a turn in memory
        Case("gpt", 1, True, None, (("n_experts", 8), ("n_layer", 4), ("aux_loss_coef", 0.5), ("z_loss_coef", 0.1)), (),
             (("ep", 2), ("schedule", "DualPipeV")), pp=2, batch=4, microbatches=4),  # DualPipeV: default m = 2p
    ],
}
LOSS_RTOL, GRAD_BOUND = 1e-6, 1e-4

runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_router_losses_split_into_pipeline_stages_match_single_process(runs, world_case):
    world_size, case = world_case
    assert_matches_single_process(runs(world_size), case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))


def test_the_router_losses_are_in_the_loss_and_the_router_gradients_on_every_stage():
    # The check above could pass if neither side had the loss, or if a stage dropped its share: with the router
    # losses, one process's loss differs, and each layer's router gradient moves far beyond the bound checked.
    from tests.helpers.models import build, token_data

    x, y = token_data(1, 1)[:2]
    values = {}
    for coef in (0.0, 0.5):
        module = build("gpt", n_experts=8, n_layer=2, aux_loss_coef=coef)
        loss = module.gpt(x, y)
        loss.backward()
        values[coef] = (loss.detach(), [m.gate.weight.grad.clone() for m in module.modules()
                                        if hasattr(m, "gate") and hasattr(m.gate, "last_logits")])
    assert not torch.equal(values[0.0][0], values[0.5][0])
    assert len(values[0.5][1]) == 2
    for without, with_ in zip(values[0.0][1], values[0.5][1]):
        assert (with_ - without).norm() > 100 * GRAD_BOUND * with_.norm()
