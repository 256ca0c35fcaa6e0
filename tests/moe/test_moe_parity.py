"""Mixtures of experts train like one process under expert parallelism (and expert tensor parallelism: each expert's
width split over expert_tp ranks), composed with tensor, sequence, data, pipeline and context parallelism, with transformers' load-balancing loss (output_router_logits) pooled over every
rank's tokens: Hugging Face Qwen3-MoE, Qwen2-MoE (gated shared expert), Mixtral, OLMoE, GLM-4.5
(sigmoid, group-limited routing, a shared expert) and GraniteMoE (gpt-oss: test_gpt_oss_parity.py), built from tiny configs and called as users call them
(``model(input_ids=x, labels=x)``); float64, the loss and every gradient (router, experts, shared experts) before each
of 3 AdamW steps."""

import pytest
import torch

from lightning_seqpar import DispatchConfig

from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, relative_error_below, world_runs

pytestmark = pytest.mark.distributed


def moe(family, tp, ep, recompute=None, pp=1, cp=1, zero=0, accumulate=1, expert_tp=1, **model):
    strategy = (("ep", ep),) + ((("zero", 1),) if zero else ()) + ((("expert_tp", expert_tp),) if expert_tp > 1 else ())
    trainer = (("accumulate_grad_batches", accumulate),) if accumulate > 1 else ()
    return Case("hf", tp, True, recompute, (("family", family), ("labels", True), *model.items()), trainer, strategy,
                pp=pp, cp=cp)


def gpt(tp, ep, recompute=None, pp=1, cp=1, aux=0.5, accumulate=1, **losses):
    """The reference GPT with 8 experts per layer (``model=gpt_moe_tiny``), its load-balancing loss at ``aux``
    (``losses``: ``aux_loss_type="per_layer"``, ``z_loss_coef``)."""
    trainer = (("accumulate_grad_batches", accumulate),) if accumulate > 1 else ()
    return Case("gpt", tp, True, recompute, (("n_experts", 8), ("aux_loss_coef", aux), *losses.items()), trainer,
                (("ep", ep),), pp=pp, cp=cp)


CASES = {
    2: [
        moe("qwen3_moe", 2, 2),                     # experts over the tp ranks, router on each rank's s/t tokens
        moe("qwen3_moe", 1, 2),                     # experts over the data-parallel ranks
        moe("qwen3_moe", 2, 1, "selective"),        # every expert on each rank: expert gradients summed over tp
        moe("qwen2_moe", 2, 2),                     # + a shared expert, gated
        moe("mixtral", 2, 2, "full"),               # whole layers recomputed: the dispatch runs again
        moe("olmoe", 2, 2),
        moe("glm4_moe", 2, 2),                      # sigmoid scores, groups, scaling, a shared expert, a dense layer
        moe("granitemoe", 2, 2, aux=0.5),           # the mixture at block_sparse_moe, Granite's multipliers
        moe("qwen3_moe", 2, 2, lora="attention"),   # LoRA on q/v: experts and router frozen, tokens' gradients flow
        moe("qwen3_moe", 2, 2, aux=0.5),            # the load-balancing loss pooled over the tp ranks' tokens
        moe("qwen3_moe", 1, 2, aux=0.5),            # ... over the data-parallel replicas'
        moe("qwen3_moe", 2, 2, aux=0.5, padding=True),  # padding left out of the counts
        moe("mixtral", 2, 1, "selective", aux=0.5, padding=True),
        moe("qwen3_moe", 2, 2, aux=0.5, accumulate=2),  # per micro-batch, scaled as the loss: not 2x
        moe("olmoe", 2, 2, freeze_router=True),     # routers frozen: no gradient there, the experts train
        gpt(2, 2),                                  # the reference GPT's experts and load-balancing loss
        gpt(1, 2, "full"),                          # experts over dp, whole layers recomputed
        gpt(2, 2, "selective", accumulate=2),
        gpt(1, 2, cp=2),                            # the loss 1/c per cp rank, summed over cp
        gpt(2, 2, aux_loss_type="per_layer", z_loss_coef=0.1),  # Megatron's per-layer loss and the z-loss
        gpt(1, 2, cp=2, accumulate=2, aux_loss_type="per_layer", z_loss_coef=0.1),
        Case("gpt", 2, True, None, (("n_experts", 8), ("aux_loss_coef", 0.5)), (),
             (("ep", 2), ("moe", DispatchConfig(8.0)))),  # a capacity that drops nothing: fixed buffers, the same step
        moe("qwen3_moe", 2, 1, expert_tp=2),        # each expert's width over the tp ranks: every rank every expert
    ],
    4: [
        moe("qwen3_moe", 2, 4),                     # four ranks' experts: over tp and dp
        moe("qwen3_moe", 2, 2, zero=1),             # ep 2 × dp 2, the distributed optimizer's ranges over edp
        moe("qwen3_moe", 1, 2, pp=2),               # pp 2 × ep 2 (1F1B)
        moe("qwen3_moe", 2, 2, cp=2, attn_implementation="sdpa"),  # tp 2 × cp 2 × ep 2
        moe("qwen3_moe", 2, 2, aux=0.5),            # tp 2 × dp 2: the loss over both groups' tokens
        moe("qwen3_moe", 2, 2, cp=2, aux=0.5, attn_implementation="sdpa"),  # and over the cp ranks'
        gpt(2, 4),                                  # ep over tp and dp
        gpt(2, 2, "selective", aux_loss_type="per_layer", z_loss_coef=0.1),  # tp 2 × dp 2
        gpt(1, 2, pp=2, aux=0.0),                   # pp 2 × ep 2, 1F1B (router losses: test_router_losses_pipelined.py)
        moe("qwen3_moe", 2, 2, aux=0.5, expert_tp=2),  # ep 2 × expert_tp 2: the experts and their widths over 4 ranks
        moe("mixtral", 2, 2, "full", expert_tp=2),  # whole layers recomputed: the slices' dispatch runs again
        moe("qwen3_moe", 1, 1, pp=2, expert_tp=2),  # pp 2 × expert_tp 2 over the data-parallel ranks
    ],
}
# As the dense families (tests/hf/test_hf_models.py): RMSNorm and the loss compute in float32 inside transformers;
# GLM-4.5's router computes in float32 too.
LOSS_RTOL, GRAD_BOUND = 1e-6, 1e-4

runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_mixture_of_experts_matches_single_process(runs, world_case):
    world_size, case = world_case
    assert_matches_single_process(runs(world_size), case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))


def test_router_and_other_replicated_gradients_are_bitwise_equal_on_every_tensor_parallel_rank(runs):
    # Each rank routes its own tokens; the router's gradient is their sum, the same bits on every rank (NCCL's
    # all-reduce, as gloo's, gives every rank one result), so the replicas never drift apart.
    case = CASES[2][0]
    first, second = (runs(2)[rank][case] for rank in (0, 1))
    for step in range(len(first.replicated)):
        assert any(name.endswith("mlp.gate.weight") for name in first.replicated[step])
        for name, grad in first.replicated[step].items():
            assert torch.equal(grad, second.replicated[step][name]), (step, name)
