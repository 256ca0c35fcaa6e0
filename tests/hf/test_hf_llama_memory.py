"""Bytes a rewritten Llama-layout layer keeps for backward at tp 2, measured live (bf16, eager attention).

Sequence parallelism divides the norm/residual terms by t and changes nothing else. Terms Table 2 lacks,
stated exactly: a Hugging Face RMSNorm keeps ``8sbh + 4sb`` bytes (its float32 copy of the input 4sbh, the
float32 rsqrt 4sb, the normalized bf16 input of its weight 2sbh, its output 2sbh); the gated MLP (SwiGLU) keeps
``8·s·b·f/t`` (gate and up outputs, silu(gate), their product: four ``[s, b, f/t]`` bf16 tensors).
"""

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

S, B, H, F, T = 64, 2, 64, 128, 2
NORMS = ("input_layernorm", "post_attention_layernorm")


def _measure(rank, world_size, sp):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_seqpar import ParallelGroup, RewriteContext, RNGTracker, rewrite
    from lightning_seqpar.memory.tracker import LiveActivationTracker

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=H, intermediate_size=F, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=S, attn_implementation="eager")
    holder = torch.nn.Module()
    holder.model = AutoModelForCausalLM.from_config(config)
    group = ParallelGroup(torch.distributed.group.WORLD)
    rewrite(holder, RewriteContext(group, sp, RNGTracker.for_tensor_parallel(0, group.rank, torch.device("cpu")), True))
    holder.to(torch.bfloat16)
    layer = "model.model.layers.1"  # between two rewritten layers: no region boundary
    with LiveActivationTracker(holder) as tracker:
        logits = holder.model(input_ids=torch.randint(0, 32, (B, S))).logits
    per_module: dict[str, int] = {}
    for record in tracker.live(layer):
        part = record.module[len(layer) + 1:]
        per_module[part] = per_module.get(part, 0) + record.nbytes
    del logits
    return per_module


@pytest.fixture(scope="module")
def measured():
    return {sp: run_distributed(_measure, T, sp)[0] for sp in (False, True)}


def test_sequence_parallel_divides_the_norm_terms_by_t_and_nothing_else(measured):
    replicated, sharded = measured[False], measured[True]
    for norm in NORMS:
        assert replicated[norm] == 8 * S * B * H + 4 * S * B  # the RMSNorm term, whole sequence
        assert sharded[norm] * T == replicated[norm]
    assert {k: v for k, v in sharded.items() if k not in NORMS} == {k: v for k, v in replicated.items() if k not in NORMS}


def test_attention_and_gated_mlp_keep_their_stated_terms(measured):
    for per_module in measured.values():
        attention = 4 * 2 * S * B * H // T  # rotated q, k and v at a/t heads (k, v repeated for GQA), o_proj's input
        swiglu = 8 * S * B * F // T  # gate and up outputs, silu(gate), their product: four [s, b, f/t] bf16
        # No copy of the weights is kept: q/k/v and gate/up share one gather without concatenating their weights.
        assert per_module[""] + per_module["activation"] == attention + swiglu
        assert per_module["activation"] == 2 * S * B * F // T
