"""``SeqParallelStrategy(compile=...)``: every rewritten block compiled as one graph, training as eager does.

- With the ``aot_eager`` backend (the autograd graphs dynamo and AOTAutograd trace, run op by op) loss and every
  gradient are bit-equal to eager training over 5 steps: the traced g/ḡ backwards reduce each gradient once.
- Every accepted dense Hugging Face family compiles with 0 graph breaks (dynamo's counters), one graph serving all
  layers alike.
- Under sequence parallelism the compiled blocks save no more bytes for backward than eager ones (no all-gathered
  ``[s, b, h]`` input kept: pytorch #146693).
- inductor on CPU: within 1e-6 of eager.
- A mixture of experts with a capacity (Qwen3-MoE at tp 2 x ep 2, and with each expert's width over expert_tp 2; the
  reference GPT's with its load-balancing and z-losses under full recomputation) trains bit-equal to eager too.
- Under context parallelism (ring and all-to-all; a Llama and the reference GPT) the halves of each pre-norm block
  around the attention across ranks are compiled, each one graph, bit-equal to eager too.
- A post-norm block under context parallelism, dropless mixtures of experts, a Hugging Face mixture recording its
  router logits and dropout from the tensor-parallel stream are refused by name before training.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_seqpar import DispatchConfig
from lightning_seqpar.transformer.compiling import CompileConfig, compile_config_of
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, build, token_data
from tests.helpers.parity import Case, fit
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed

STEPS = 5
AOT = (("compile", {"backend": "aot_eager"}),)
PARITY = [  # each trained eager and compiled, compared bit for bit
    Case("gpt", 2),                                                     # reference GPT, tp 2 + SP
    Case("gpt", 2, recompute="selective"),                              # core attention checkpointed in the graph
    Case("gpt", 2, recompute="full", model=(("n_layer", 4),)),          # compiled bodies inside eager checkpoints
    Case("gpt", 1, pp=2),                                               # blocks of two pipeline stages
    Case("hf", 2, recompute="selective", model=(("labels", True),)),    # Llama, labels= loss
    Case("hf", 2, model=(("labels", True), ("lora", "all"))),           # LoRA adapters on the parallel linears
    Case("hf", 2, sequence_parallel=False, model=(("family", "gpt2"),)),  # tensor parallel without SP
    Case("encoder", 2, recompute="selective"),                          # torch's encoder layer
    Case("gpt", 1, strategy=(("zero", 1),)),                            # dp 2: buckets and sharded optimizer
    Case("hf", 2, model=(("labels", True),), trainer=(("precision", "bf16-mixed"),),
         strategy=(("low_precision_residual", True),)),                 # autocast traced; norms' forwards replaced
    Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True)),
         strategy=(("ep", 2), ("moe", DispatchConfig(1.0)))),           # Qwen3-MoE, tp 2 x ep 2, expert capacity
    Case("gpt", 1, recompute="full", model=(("n_experts", 8), ("aux_loss_coef", 0.5), ("z_loss_coef", 0.01)),
         strategy=(("ep", 2), ("moe", DispatchConfig(1.0, drop_policy="probs")))),  # + load-balancing and z-losses
    Case("hf", 1, cp=2, model=(("labels", True),)),                     # Llama, cp 2 ring: halves around the ring
    Case("hf", 1, cp=2, recompute="full", model=(("labels", True),),
         strategy=(("cp_comm", "all_to_all"),)),                        # all-to-all, inside full recomputation
    Case("gpt", 1, cp=2),                                               # the reference GPT under cp 2
    Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True)),
         strategy=(("expert_tp", 2), ("moe", DispatchConfig(1.0)))),    # each expert's width over 2 ranks, a capacity
]
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "qwen2_window", "gemma", "gemma2", "gemma3",
            "cohere", "cohere2", "stablelm", "phi", "phi3", "starcoder2", "glm", "gpt_neox", "olmo2", "smollm3",
            "granite", "gpt2", "falcon", "falcon_sequential"]
"""The dense Hugging Face families the rewrite accepts at tp 2 (falcon_multi_query has one k/v head: tp 1)."""


def _compiled(case: Case, how: tuple = AOT) -> Case:
    return dataclasses.replace(case, strategy=(*case.strategy, *how))


def _counted(case: Case, world: int, steps: int):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    record = fit(case, world, steps=steps)
    return record, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _saved_bytes(rank: int, world: int, compiled: bool) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the tensors one training forward of a tp-2 + SP Llama (its loss from ``labels=``) saves for backward,
    parameters excluded, each storage once; and the shapes saved."""
    import lightning.pytorch as pl

    from lightning_seqpar import SeqParallelStrategy

    module = build("hf", labels=True, layers=2)
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=strategy_of(tp=2, compile={"backend": "aot_eager"} if compiled else False))
    data = token_data(1, 1)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.compute_loss(data.tensors[0][:2], data.tensors[1][:2])
    del loss
    return sum(seen.values()), shapes


def _world(rank: int, world: int) -> dict:
    results: dict = {}
    for case in PARITY:
        results[case] = (fit(case, world, steps=STEPS), _counted(_compiled(case), world, STEPS))
    results["families"] = {}
    for family in FAMILIES:
        case = Case("hf", 2, recompute="selective", model=(("family", family), ("labels", True)), strategy=AOT)
        record, breaks, graphs = _counted(case, world, 1)
        results["families"][family] = (breaks, graphs, record.losses)
    results["saved"] = {compiled: _saved_bytes(rank, world, compiled) for compiled in (False, True)}
    refused = {}
    for name, case in {"cp": Case("encoder", 1, cp=2, model=(("norm_first", False),), strategy=AOT),
                       "moe": Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True)), strategy=AOT),
                       "router logits": Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True), ("aux", 0.5)),
                                             strategy=(("moe", DispatchConfig(1.0)), *AOT)),
                       "dropout": Case("gpt", 2, model=(("dropout", 0.1),), strategy=AOT)}.items():
        try:
            fit(case, world, steps=1)
            refused[name] = ""
        except ValueError as error:
            refused[name] = str(error)
    results["refused"] = refused
    return results


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, 2)


@pytest.mark.parametrize("case", PARITY, ids=lambda c: f"{c.kind}-pp{c.pp}tp{c.tp}-{c.recompute}-{dict(c.model)}"
                                                      f"-{dict(c.strategy)}-{dict(c.trainer)}")
def test_compiled_blocks_train_bit_equal_to_eager_with_aot_eager(world, case):
    for rank, results in enumerate(world):
        eager, (compiled, breaks, graphs) = results[case]
        assert breaks == 0 and graphs >= 1, (rank, breaks, graphs)
        assert compiled.losses == eager.losses and compiled.logged == eager.logged, rank
        assert len(compiled.grads) == len(eager.grads) == STEPS
        for step, (got, want) in enumerate(zip(compiled.grads, eager.grads)):
            assert got.keys() == want.keys()
            differ = [name for name in want if not torch.equal(got[name], want[name])]
            assert differ == [], f"rank {rank} step {step}: {differ}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_dense_family_compiles_without_a_graph_break(world, family):
    for results in world:
        breaks, graphs, losses = results["families"][family]
        assert breaks == 0
        assert 1 <= graphs <= 2  # one graph for all layers alike (windowed and full layers: two)
        assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()


def test_compiled_blocks_save_no_more_for_backward_than_eager_under_sequence_parallelism(world):
    for results in world:
        (eager, eager_shapes), (compiled, compiled_shapes) = results["saved"][False], results["saved"][True]
        assert 0 < compiled <= eager, (compiled, eager)
        # no all-gathered [s, b, h] input kept beside what eager keeps of that shape (the MLP's [s, b, f/t] is one)
        gathered = (SEQ, 2, 16)
        assert compiled_shapes.count(gathered) <= eager_shapes.count(gathered), (compiled_shapes, eager_shapes)


def test_post_norm_context_parallel_experts_and_stream_dropout_are_refused_by_name_before_training(world):
    refused = world[0]["refused"]
    assert "post-norm block attending across 2 context-parallel ranks" in refused["cp"], refused["cp"]
    assert "compile=False, or cp=1" in refused["cp"]
    assert "dropless mixture of experts" in refused["moe"] and "moe=DispatchConfig(capacity_factor=...)" in refused["moe"]
    assert "output_router_logits=True" in refused["router logits"] and "Qwen3MoeConfig" in refused["router logits"]
    assert "dropout (attention p=0.1" in refused["dropout"] and "set the model's dropout to 0" in refused["dropout"]


def _inductor(rank: int, world: int):
    case = Case("hf", 2, recompute="selective", model=(("labels", True),))
    eager = fit(case, world, steps=3)
    compiled, breaks, _ = _counted(_compiled(case, (("compile", True),)), world, 3)
    return eager, compiled, breaks


def test_inductor_blocks_train_within_1e_6_of_eager_on_cpu():
    """inductor's own CPU kernels (C++; fused, reordered sums): a Llama at tp 2 + SP, selective recomputation, 3
    steps: the same losses and every gradient within 1e-6 of its largest element."""
    for eager, compiled, breaks in run_distributed(_inductor, 2):
        assert breaks == 0
        torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-6, atol=0)
        for got, want in zip(compiled.grads, eager.grads):
            worst = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)).item() for n in want}
            assert max(worst.values()) <= 1e-6, worst


def test_compile_settings_are_checked_when_given():
    assert compile_config_of(False) is None and compile_config_of(None) is None
    assert compile_config_of(True) == CompileConfig()
    assert compile_config_of({"backend": "aot_eager"}) == CompileConfig("aot_eager")
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        CompileConfig("tensorrt_typo")
    with pytest.raises(ValueError, match="mode="):
        CompileConfig(mode="fast")
    with pytest.raises(ValueError, match="unknown key"):
        compile_config_of({"backend": "inductor", "fullgraph": False})
    with pytest.raises(ValueError, match="compile="):
        compile_config_of("yes")
