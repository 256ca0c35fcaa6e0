"""Hugging Face causal LMs under context parallelism train like one process: float64, the loss every rank logs and
every parameter's gradient over 3 AdamW steps, called as users call them (``model(input_ids=x, labels=x)``).

Ring and all-to-all attention; cp 2 and 4; tp 2 × cp 2 with and without sequence parallelism; pp 2 × cp 2;
cp 2 × dp 2 with the distributed optimizer; eager (blocks op by op) and SDPA (blocks by the fused kernel that
returns the log-sum-exp); padding, explicit positions, sliding windows (full and
window layers mixed), soft-capping, packed documents (position ids restarting at 0; on one cp rank too, where the
one-process reference is given the documents' 4-D mask); labels of -100 spread unevenly over the cp ranks (the loss stays the token-weighted
mean of one process); the reference GPT (learned positions, label smoothing); a user's own ``nn.TransformerEncoder`` GPT called as a causal
encoder (its stack on the cp rank's chunks, the sequence gathered back for its head and loss); a model of declared blocks whose step
takes its share with ``context_parallel_batch``; the LM head and loss over chunks of the sequence (``loss_chunk``, final-logit soft-caps and
scales included); Llama (grouped-query attention), Qwen3 (per-head q/k norms), GPT-2 (learned positions), Gemma 2;
selective and full recomputation.
"""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, all_cases, assert_matches_single_process, case_id, fit, relative_error_below, run_cases
from tests.helpers.user_block import POLICY

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

LABELS = (("labels", True),)
A2A = (("cp_comm", "all_to_all"),)
PADDED = (("padding", True), ("ignored_labels", "padding"))  # collators label padding -100
DECLARED = (("policies", (POLICY,)),)  # a user's own block, declared; its step takes its share of the batch
CAUSAL = (("causal_hint", True),)  # a user's nn.TransformerEncoder GPT, called with is_causal=True as torch documents

CASES = {
    2: [
        Case("hf", 1, True, None, LABELS, cp=2),                                   # ring, grouped-query attention
        Case("hf", 1, True, None, LABELS, strategy=A2A, cp=2),                     # all-to-all
        Case("hf", 1, True, "full", LABELS + PADDED, cp=2),                        # padding, full recomputation
        Case("hf", 1, True, "selective", LABELS + (("attn_implementation", "sdpa"), ("position_offset", 5)), cp=2),
        Case("hf", 1, True, None, LABELS + (("ignored_labels", "uneven"),), cp=2),  # -100 mostly on one rank's tokens
        Case("hf", 1, True, None, LABELS + (("family", "gpt2"),), cp=2),           # learned positions
        Case("hf", 1, True, None, LABELS + (("family", "qwen3"),), strategy=A2A, cp=2),
        Case("hf", 1, True, None, LABELS + (("family", "mistral_window"), ("attn_implementation", "sdpa")) + PADDED,
             cp=2),                                                                 # a window < s on every layer
        Case("hf", 1, True, None, LABELS + (("family", "mistral_window"), ("attn_implementation", "sdpa")) + PADDED,
             strategy=A2A, cp=2),
        Case("hf", 1, True, "selective", LABELS + (("family", "qwen2_window"),), cp=2),  # full and window layers
        Case("hf", 1, True, None, LABELS + (("family", "gemma2"),), cp=2),         # soft-capped scores, windows
        Case("hf", 1, True, None, LABELS + (("documents", True),), cp=2),          # packed documents
        Case("hf", 1, True, "full", LABELS + (("documents", True),), strategy=A2A, cp=2),
        Case("hf", 1, True, None, LABELS + (("documents", True), ("attn_implementation", "sdpa")), strategy=A2A,
             cp=2),                                                                 # the fused kernel per block
        Case("hf", 2, True, None, LABELS + (("documents", True),)),                # one cp rank: documents kept apart
        Case("hf", 1, True, None, LABELS + (("documents", True),), pp=2),          # t = c = 1: the model's entry alone
        Case("hf", 1, True, None, LABELS + (("documents", True),)),                # dp 2, nothing split around layers
        Case("hf", 2, True, None, LABELS, strategy=(("loss_chunk", 2),)),          # the loss over chunks of 2
        Case("hf", 2, True, "selective", LABELS + (("family", "gemma2"),), strategy=(("loss_chunk", 3),)),  # soft-cap
        Case("hf", 1, True, None, LABELS + (("family", "granite"),), strategy=(("loss_chunk", 1),), cp=2),  # scaling
        Case("hf", 2, True, None, (("family", "gemma2"),), strategy=(("loss_chunk", 3),)),  # .logits read: computed whole
        Case("hf", 1, True, None, LABELS + (("family", "gemma3"),), cp=2),         # local/global rotary, window layers
        Case("gpt", 1, True, None, cp=2),                                          # the reference GPT: label smoothing
        Case("gpt", 1, True, "full", strategy=A2A, cp=2),                          # layers recomputed in backward
        Case("gpt", 1, True, "selective", strategy=A2A + (("loss_parallel", False),), cp=2),
        Case("nano_cp", 1, True, None, strategy=DECLARED, cp=2),                   # declared blocks
        Case("encoder", 1, True, None, CAUSAL, cp=2),                              # ring, padding, batch-first
        Case("encoder", 1, True, "selective", CAUSAL + (("batch_first", False),), strategy=A2A, cp=2),
    ],
    4: [
        Case("hf", 2, True, None, LABELS, cp=2),                                   # tp 2 × cp 2, SP
        Case("hf", 2, False, None, LABELS, cp=2),                                  # tp 2 × cp 2, no SP
        Case("hf", 2, True, "selective", LABELS + (("kv_heads", 4),), strategy=A2A, cp=2),
        Case("hf", 1, True, None, LABELS, cp=4),
        Case("hf", 1, True, None, LABELS + (("kv_heads", 4),), strategy=A2A, cp=4),
        Case("hf", 1, True, None, LABELS, pp=2, cp=2),                             # stage transfers of s/c tokens
        Case("hf", 1, True, None, LABELS, strategy=(("zero", 1),), cp=2),          # cp 2 × dp 2, distributed optimizer
        Case("hf", 2, True, "full", LABELS + (("family", "qwen3"),), cp=2),
        Case("hf", 2, True, None, LABELS + (("family", "gpt2"),), cp=2),
        Case("hf", 2, True, None, LABELS + (("documents", True), ("family", "qwen3")), cp=2),
        Case("hf", 2, True, None, LABELS, strategy=(("loss_chunk", 1),), cp=2),
        Case("hf", 2, True, None, LABELS + (("attn_implementation", "sdpa"), ("documents", True)), cp=2),  # fused
        Case("gpt", 2, True, None, cp=2),
        Case("gpt", 1, True, None, pp=2, cp=2),
        Case("nano_cp", 2, True, "selective", strategy=DECLARED, cp=2),
        Case("nano_cp", 1, True, None, strategy=DECLARED + A2A, cp=4),
        Case("encoder", 2, True, None, CAUSAL, cp=2),                              # tp 2 (+SP) × cp 2
        Case("encoder", 1, True, None, CAUSAL + (("norm_first", False),), cp=2),   # cp 2 × dp 2, post-norm
    ],
}

_results: dict = {}


def _per_rank(world_size):
    if world_size not in _results:
        _results[world_size] = run_cases(CASES, world_size)
    return _results[world_size]


@pytest.mark.parametrize("world_case", all_cases(CASES), ids=case_id)
def test_context_parallel_training_matches_one_process(world_case):
    world_size, case = world_case
    assert_matches_single_process(_per_rank(world_size), case, world_size, loss_rtol=1e-6, loss_atol=1e-8,
                                  grad_matches=relative_error_below(1e-4))


def _without_its_share(rank, world_size):
    try:
        fit(Case("nano", 1, True, None, strategy=DECLARED, cp=2), world_size)
    except RuntimeError as error:
        return str(error)
    return None


def test_a_model_of_declared_blocks_that_does_not_take_its_share_is_refused_at_its_first_forward():
    for message in run_distributed(_without_its_share, 2):
        assert message is not None and "context_parallel_batch(self, input_ids, labels=...)" in message
