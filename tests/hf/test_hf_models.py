"""Hugging Face causal LMs train under TP (+SP) and PP like one process, and their weights go in and out.

Every model is called as transformers' examples call it: ``model(input_ids=x, labels=x)``, with the config's
default ``use_cache``; also with a padding ``attention_mask`` and explicit ``position_ids``.

Tiny random configs: Llama, Mistral, Qwen2, Qwen3, Gemma (its embedding scaled by √h) and SmolLM3 (every other layer
without rotary embeddings) (Llama layout; Qwen3 with per-head q/k norms: grouped-query attention with 2 key/value heads for 4 query
heads, rotary embeddings, RMSNorm, SwiGLU) and GPT-2 (Conv1D, fused c_attn, learned positions, tied head);
float64, loss and every gradient over 3 AdamW steps.
"""

import pytest
import torch

from lightning_seqpar import explain
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, token_data
from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, relative_error_below, world_runs

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


CASES = {
    2: [
        Case("hf", 2, True, None),                                          # TP + SP, eager, hand-written loss
        Case("hf", 2, False, None),                                         # TP only
        Case("hf", 2, True, "selective"),                                   # selective recompute of core attention
        Case("hf", 2, True, None, (("attn_implementation", "sdpa"),)),      # fused attention
        Case("hf", 2, True, None, (("labels", True), ("bias", True), ("tie", True))),  # labels=, q/k/v bias, tied
        Case("hf", 2, True, None, (("family", "qwen2"),)),                  # another family of the same layout
        Case("hf", 2, True, "selective", (("family", "qwen3"), ("labels", True))),  # per-head q/k norms
        Case("hf", 2, True, None, (("family", "mistral"),)),                # full attention
        Case("hf", 1, True, None, pp=2),                                    # pp 2: the decoder layer list is the stack
        Case("hf", 2, True, None, (("family", "gpt2"),)),                   # GPT-2: Conv1D, fused c_attn, tied head
        Case("hf", 2, True, "selective", (("family", "gpt2"), ("labels", True))),
        Case("hf", 1, True, None, (("family", "gpt2"),), pp=2),
        Case("hf", 2, True, None, (("padding", True), ("labels", True))),    # padding attention_mask, eager
        Case("hf", 2, True, None, (("padding", True), ("attn_implementation", "sdpa"))),
        Case("hf", 2, True, "selective", (("position_offset", 5),)),        # explicit position_ids
        Case("hf", 2, True, None, (("family", "gemma"), ("labels", True))),  # embedding scaled by √h, (1 + w) norms
        Case("hf", 2, True, None, (("family", "smollm3"), ("labels", True))),  # a layer without rotary embeddings
        Case("hf", 2, True, None, (("family", "mistral_window"),)),         # sliding window < sequence, eager
        Case("hf", 2, True, None, (("family", "mistral_window"), ("attn_implementation", "sdpa"), ("padding", True))),
        Case("hf", 2, True, "selective", (("family", "qwen2_window"), ("labels", True))),  # full and window layers
        Case("hf", 2, True, None, (("family", "gemma2"), ("labels", True))),  # sandwich norms, soft-capping, windows
        Case("hf", 2, True, "selective", (("family", "gemma2"),)),           # soft-capped logits read as .logits
        Case("hf", 2, True, None, (("family", "gemma3"), ("labels", True))),  # + q/k norms, local/global rotary
        Case("hf", 2, True, None, (("family", "cohere"), ("labels", True))),  # parallel residual, logit scale
        Case("hf", 2, True, "selective", (("family", "cohere2"), ("labels", True))),  # rotary on window layers only
        Case("hf", 2, True, None, (("family", "stablelm"), ("labels", True))),  # partial rotary
        Case("hf", 2, True, None, (("family", "phi"), ("labels", True))),     # parallel residual, head bias
        Case("hf", 2, True, None, (("family", "starcoder2"), ("labels", True))),  # plain MLP with biases
        Case("hf", 2, True, "selective", (("family", "phi3"), ("labels", True))),  # fused qkv_proj (GQA), gate_up_proj
        Case("hf", 2, True, None, (("family", "phi3"), ("kv_heads", 4))),  # fused q, k, v of equal sizes
        Case("hf", 2, True, None, (("family", "glm"), ("labels", True))),     # fused gate_up_proj, partial rotary
        Case("hf", 2, True, None, (("family", "gpt_neox"), ("labels", True))),  # per-head fused q/k/v, two norms
        Case("hf", 2, True, "selective", (("family", "gpt_neox"), ("parallel_residual", False))),
        Case("hf", 2, True, None, (("family", "olmo2"), ("labels", True))),   # post-norms, q/k norms over all heads
        Case("hf", 2, True, None, (("family", "granite"), ("labels", True))),  # embedding/residual/score/logit multipliers
        Case("hf", 2, True, "selective", (("family", "stablelm"), ("qk_norm", True))),  # a LayerNorm per head
        Case("hf", 2, True, None, (("family", "cohere"), ("qk_norm", True), ("labels", True))),  # [a, d] norm weights
        Case("hf", 2, True, None, (("family", "falcon"), ("labels", True))),  # q/k/v grouped per k/v head, two norms
        Case("hf", 2, True, "selective", (("family", "falcon_sequential"),)),  # [q_h; k_h; v_h], sequential residual
        Case("hf", 1, True, None, (("family", "falcon_multi_query"), ("labels", True)), pp=2),  # one k/v head: tp 1
    ],
    4: [
        Case("hf", 2, True, "selective"),                                   # tp 2 x dp 2
        Case("hf", 2, True, None, (("labels", True), ("tie", True)), pp=2),  # pp 2 x tp 2, tied embedding
        Case("hf", 2, True, None, (("labels", True),), pp=2),               # pp 2 x tp 2, untied
        Case("hf", 2, True, None, (("labels", True),), strategy=(("schedule", "ZB-H1"),), pp=2),  # B/W split
        Case("hf", 1, True, None, (("labels", True), ("family", "qwen3_moe")), strategy=(("schedule", "ZB-H1"),),
             pp=2, cp=2),                                                   # experts (grads in B), ring, ZB-H1
        Case("hf", 2, True, None, (("family", "qwen2_window"), ("labels", True)), pp=2),  # windows over the stages
        Case("hf", 2, True, None, (("family", "gemma2"), ("labels", True)), pp=2),  # final soft-cap on the last stage
        Case("hf", 2, True, None, (("family", "cohere"), ("labels", True)), pp=2),  # parallel residual over stages
        Case("hf", 2, True, None, (("family", "phi"), ("labels", True)), pp=2),  # head bias on the last stage
        Case("hf", 2, True, None, (("family", "phi3"), ("labels", True)), pp=2),  # fused projections over stages
        Case("hf", 2, True, None, (("family", "gpt_neox"), ("labels", True)), pp=2),  # its head named by the model
        Case("hf", 2, True, "selective", (("family", "olmo2"), ("labels", True)), pp=2),
        Case("hf", 4, True, None, (("family", "olmo2"), ("labels", True), ("kv_heads", 4))),  # the statistic over tp 4
        Case("hf", 4, True, None, (("family", "gemma2"), ("labels", True), ("kv_heads", 4))),  # soft-caps at tp 4
        Case("hf", 4, True, None, (("family", "phi3"), ("labels", True), ("kv_heads", 4))),  # fused at tp 4
        Case("hf", 4, True, None, (("family", "gpt_neox"), ("labels", True))),  # one head per rank
        Case("hf", 2, True, None, (("family", "gemma3"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "cohere2"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "stablelm"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "starcoder2"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "glm"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "mistral_window"), ("labels", True)), pp=2),
        Case("hf", 2, True, None, (("family", "granite"), ("labels", True)), pp=2),  # logits scaled on the last stage
        Case("hf", 4, True, None, (("family", "cohere"), ("qk_norm", True), ("kv_heads", 4))),  # one head's weights
        Case("hf", 2, True, None, (("family", "falcon"), ("labels", True)), pp=2),  # (hidden, None) across stages
        Case("hf", 4, True, None, (("family", "falcon"), ("kv_heads", 4), ("attn_implementation", "sdpa"))),
        Case("hf", 2, True, None, (("family", "stablelm"), ("qk_norm", True), ("labels", True)), (), (("zero", 1),)),
        Case("hf", 1, True, None, (("labels", True), ("tie", True), ("layers", 4)), pp=4, batch=4),  # embedding group of 2 of 4
        Case("hf", 1, True, None, (("labels", True), ("tie", True)), (("gradient_clip_val", 0.05),), (("zero", 1),),
             pp=2),  # pp 2 x dp 2, distributed optimizer: a tied embedding's ranges summed between the two stages
        Case("hf", 2, True, None, (("labels", True), ("tie", True), ("layers", 4)), strategy=(("schedule", "ZB-V"),),
             pp=2),                                                         # ZB-V: embedding and tied head on rank 0
        Case("hf", 1, True, "selective", (("labels", True), ("layers", 4)), strategy=(("schedule", "ZB-V"),), pp=2,
             cp=2),                                                         # ZB-V × cp 2 (ring)
        Case("hf", 2, True, None, (("labels", True), ("tie", True), ("layers", 4)),
             strategy=(("schedule", "DualPipeV"),), pp=2, batch=4),          # DualPipeV, pp 2 × tp 2, m = 2p
        Case("hf", 1, True, "selective", (("labels", True), ("layers", 4)), strategy=(("schedule", "DualPipeV"),),
             pp=2, cp=2, batch=4),                                          # DualPipeV × cp 2 (ring)
    ],
}
# Hugging Face's RMSNorm and its causal-LM loss compute in float32 whatever the input's dtype, so float64 runs agree
# only to float32 rounding where the tensor-parallel sums (in float64, another order) and the vocabulary-parallel loss
# (float32 on shards, another summation order) cross it: ~1e-7 relative on the loss, and after AdamW steps up to
# ~4e-5 relative on a whole gradient tensor. Gradients are compared by the relative error of the whole tensor: a
# missing reduction (a factor t = 2) gives >= 0.5.
LOSS_RTOL, GRAD_BOUND = 1e-6, 1e-4


runs = world_runs(CASES)


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_llama_layout_matches_single_process(runs, world_case):
    world_size, case = world_case
    per_rank = runs(world_size)
    assert_matches_single_process(per_rank, case, world_size, LOSS_RTOL, 0, relative_error_below(GRAD_BOUND))


def test_explain_names_the_layout_and_the_split(capsys):
    plan = explain(build("hf"), tp=2)
    vocabulary, first, last = plan.entries
    assert vocabulary.name == "model" and first.enter_region and last.exit_region
    assert ("LlamaForCausalLM: model.embed_tokens vocabulary-parallel (13 rows, padded 14 → 7 per rank), lm_head "
            "column-parallel over the vocabulary; labels= gives the vocabulary-parallel loss") in str(plan)
    assert "LlamaDecoderLayer (Llama layout): 4 query / 2 key-value heads → 2 / 1 per rank" in str(plan)
    assert "attention sdpa (fused kernel: no s² tensor" in str(explain(build("hf", attn_implementation="sdpa"), tp=2))
    gpt2 = str(explain(build("hf", family="gpt2"), tp=2))
    assert "GPT2Block (GPT-2 layout): 4 heads → 2 per rank (attn.c_attn column-parallel" in gpt2


def test_bad_llama_inputs_fail_before_any_collective_with_the_numbers():
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2 is not divisible by .* tp = 4.*Valid tp: \[1, 2\]"):
        explain(build("hf"), tp=4)
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
        module = build("hf")
        module.model.config._attn_implementation = "flex_attention"
        explain(module, tp=2)


def _round_trip(rank, world_size, pretrained, exported):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_seqpar import SeqParallelStrategy

    module = build("hf", tie=True)
    torch.nn.init.normal_(module.model.model.embed_tokens.weight)  # other weights than the directory's
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=2), precision="64-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    x, y = token_data(1, 1, seed=3).tensors
    trainer.validate(module, DataLoader([(x[0], y[0])], batch_size=1), verbose=False)  # sets up the parallel model
    trainer.strategy.load_single_device_state_dict(pretrained, prefix="model.")
    module.eval()
    with torch.no_grad():
        logits = module(x)
    trainer.strategy.save_hf_pretrained(exported, module.model.config)
    return logits


def test_pretrained_directory_in_and_out_gives_the_one_device_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    source = build("hf", tie=True).model.double()
    torch.nn.init.normal_(source.model.layers[1].mlp.down_proj.weight)  # not the seeded init
    source.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "pretrained" / "model.safetensors.index.json").exists()
    x = token_data(1, 1, seed=3).tensors[0]
    with torch.no_grad():
        want = source(input_ids=x).logits
    for logits in run_distributed(_round_trip, 2, str(tmp_path / "pretrained"), str(tmp_path / "exported")):
        torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-10)  # each rank read its own slices
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float64)
    with torch.no_grad():
        got = reloaded(input_ids=x).logits
    # Same weights; built directly in float64, the reloaded model's rotary table is not the float32-rounded one of
    # the source (built in float32, then converted): ~3e-8 apart.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_the_sliding_windows_of_the_parity_cases_mask_and_a_window_over_the_sequence_is_full_attention():
    # The windowed parity cases above are exact; here, that their window changes what one device computes (so the
    # parity is about the window), and that a window covering the sequence is full causal attention.
    from tests.helpers.hf_models import WINDOW
    from tests.helpers.models import SEQ

    x = token_data(1, 1)[0][0].unsqueeze(0)
    for family in ("mistral_window", "qwen2_window"):
        torch.manual_seed(0)
        windowed = build("hf", family=family).double().eval()
        full = build("hf", family=family).double().eval()
        full.load_state_dict(windowed.state_dict())
        assert WINDOW < SEQ
        full.model.config.sliding_window = SEQ  # the whole sequence
        with torch.no_grad():
            narrow, wide = windowed(x), full(x)
            full.model.config.sliding_window = None
            if family == "mistral_window":
                torch.testing.assert_close(wide, full(x), rtol=0, atol=0)
        assert not torch.allclose(narrow, wide)
