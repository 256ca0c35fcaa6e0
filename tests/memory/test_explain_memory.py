"""``explain(..., seq_len=)``: the bytes each recomputation/offload choice leaves per layer, for the model's own sizes
at the explained layout; the table's figures are those the tracker measures on the reference GPT's layer."""

from __future__ import annotations

import pytest

from lightning_seqpar import explain
from lightning_seqpar.memory import TransformerShape
from lightning_seqpar.memory.choices import MEMORY_CHOICES, choice_bytes
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup
from recipes.benchmarking.measure import measure_gpt_layer

SHAPE = TransformerShape(s=64, b=2, h=64, a=4)


def _gpt(dropout: float = 0.1) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=dropout))


@pytest.mark.parametrize("tp, cp", [(2, 1), (4, 1), (2, 2)])
def test_explain_tables_every_choice_for_the_model_s_layer(tp, cp, capsys):
    dropout = 0.1 if cp == 1 else 0.0  # (the ring refuses attention dropout)
    plan = explain(_gpt(dropout), tp=tp, cp=cp, seq_len=64, micro_batch_size=2)
    memory = plan.memory
    assert (memory.shape.h, memory.shape.a, memory.shape.f, memory.shape.s, memory.shape.b) == (64, 4, 256, 64, 2)
    assert (memory.t, memory.sequence_parallel, memory.c) == (tp, True, cp)
    assert memory.rows == choice_bytes(memory.shape, tp, True, c=cp, norm_statistics_bytes=4)
    labels = [row.choice for row in memory.rows]
    assert labels == list(MEMORY_CHOICES)
    # the paper's layer: the table is exact for it (without dropout, less the masks it counts)
    assert ("This layer has" in memory.note) == (dropout == 0) and "grouped-query" not in memory.note
    printed = capsys.readouterr().out
    assert "Activations kept per layer and micro-batch" in printed and "selective + layernorm + mlp" in printed


def test_without_seq_len_explain_tables_no_memory():
    assert explain(_gpt(), tp=2).memory is None
    with pytest.raises(ValueError, match="seq_len=0"):
        explain(_gpt(), tp=2, seq_len=0)


@pytest.mark.parametrize("label", list(MEMORY_CHOICES))
def test_each_row_is_what_the_tracker_measures_on_the_layer(label):
    """At t = 1 on the CPU (LayerNorm statistics in the activations' dtype, 2 bytes): the device and host bytes of each
    row equal the measured ones, to the byte."""
    recompute, modules, offload = MEMORY_CHOICES[label]
    row = {r.choice: r for r in choice_bytes(SHAPE, 1, False, norm_statistics_bytes=2)}[label]
    m = measure_gpt_layer(SHAPE, ParallelGroup.virtual(1), False, recompute, modules=modules, offload=offload,
                          norm_statistics_bytes=2)
    assert m.measured_bytes - m.remainder().get("RNG state snapshot", 0) == row.device_bytes
    assert m.offloaded_bytes == row.host_bytes


def test_a_layer_unlike_the_paper_s_is_named_with_where_to_measure_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2)
    note = explain(transformers.LlamaForCausalLM(config), tp=2, seq_len=64).memory.note
    for departure in ("grouped-query attention", "a gated MLP", "fused core attention", "no dropout",
                      "python -m lightning_seqpar.plan"):
        assert departure in note
    assert "dropout" not in explain(_gpt(), tp=2, seq_len=64).memory.note


def _gpt_moe() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, n_experts=4,
                         expert_ffn_hidden_size=48))


def test_explain_tables_a_mixture_s_choices_with_its_experts_split_as_the_layout_says():
    from lightning_seqpar.memory.choices import MIXTURE_CHOICES
    from lightning_seqpar.memory.mixture import MixtureShape

    memory = explain(_gpt_moe(), tp=2, ep=2, expert_tp=1, seq_len=64, micro_batch_size=2).memory
    experts = MixtureShape(4, 2, 48, ep=2)
    assert memory.rows == choice_bytes(memory.shape, 2, True, norm_statistics_bytes=4, experts=experts)
    assert [row.choice for row in memory.rows] == list(MIXTURE_CHOICES)
    assert "balanced routing" in memory.note and "does not price" not in memory.note
    rows = {row.choice: row for row in memory.rows}
    assert rows["selective + moe"].device_bytes < rows["selective + moe_act"].device_bytes < rows[
        "selective"].device_bytes
    assert rows["selective | offload expert_fc1, moe_act"].host_bytes > 0
    wider = explain(_gpt_moe(), tp=2, ep=1, expert_tp=2, seq_len=64, micro_batch_size=2).memory
    assert wider.rows == choice_bytes(memory.shape, 2, True, norm_statistics_bytes=4,
                                      experts=MixtureShape(4, 2, 48, expert_tp=2))


@pytest.mark.parametrize("label", ["none", "selective + moe_act", "selective + layernorm + moe",
                                   "selective | offload expert_fc1, moe_act", "none | offload all"])
def test_each_mixture_row_is_what_the_tracker_measures_on_the_layer(label):
    """On one rank every (token, expert) pair stays here, so balanced routing is the routing: the rows are exact."""
    from lightning_seqpar.memory.choices import MIXTURE_CHOICES
    from lightning_seqpar.memory.mixture import MixtureShape

    recompute, modules, offload = MIXTURE_CHOICES[label]
    experts = MixtureShape(4, 2, 48)
    row = {r.choice: r for r in choice_bytes(SHAPE, 1, False, norm_statistics_bytes=2, experts=experts)}[label]
    m = measure_gpt_layer(SHAPE, ParallelGroup.virtual(1), False, recompute, modules=modules, offload=offload,
                          norm_statistics_bytes=2, experts=experts)
    assert m.measured_bytes - m.remainder().get("RNG state snapshot", 0) == row.device_bytes
    assert m.offloaded_bytes == row.host_bytes
