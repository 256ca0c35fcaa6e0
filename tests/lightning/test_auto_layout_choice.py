"""What ``layout=AutoLayout(...)`` plans, on one process: the reference GPT is priced as the GPT-2 of its sizes
(parameter for parameter), and a sequence too long for any layout without context parallelism gets one with it,
which the strategy's configuration takes (cp and its communication)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from lightning_seqpar.lightning.auto_layout import AutoLayout, auto_layout_of, choose_layout, planned_model, rank_layouts
from lightning_seqpar import Layout
from lightning_seqpar.lightning.memory_callbacks import layout_of_run
from lightning_seqpar.models import GPTConfig, GPTLightningModule
from lightning_seqpar.plan import inventory_of_hf_model

pytestmark = pytest.mark.slow  # the planner's probes: the full suite runs it, the fast lane does not

LONG, WORLD = 4096, 4  # s at which the eager attention's s² probabilities, not the weights, fill a rank


def _shapes(model):
    return sorted(tuple(sorted(p.shape)) for p in model.parameters())  # GPT-2's Conv1D holds the Linear's transpose


@pytest.mark.parametrize("options", [dict(), dict(tie_weights=False, ffn_hidden_size=200, vocab_size=13,
                                                  block_size=8, n_embd=16, n_layer=3)])
def test_the_reference_gpt_is_planned_as_gpt2_with_its_parameters_one_for_one(options):
    module = GPTLightningModule(GPTConfig(**options))
    planned = planned_model(module)
    assert type(planned).__name__ == "GPT2LMHeadModel" and planned.device.type == "meta"
    assert _shapes(planned) == _shapes(module.gpt)
    assert inventory_of_hf_model(planned).num_layers == module.gpt.config.n_layer


@pytest.mark.parametrize("options, part", [(dict(bias=False), "bias=False"), (dict(n_experts=4), "n_experts > 0")])
def test_a_reference_gpt_gpt2_cannot_price_is_refused_naming_the_part(options, part):
    with pytest.raises(ValueError, match=f"this one has {part}.*Give SeqParallelStrategy tp, pp"):
        planned_model(GPTLightningModule(GPTConfig(**options)))


def test_a_long_sequence_gets_context_parallelism_and_the_strategy_takes_it():
    module = GPTLightningModule(GPTConfig(vocab_size=13, block_size=LONG, n_layer=2, n_head=4, n_embd=16))
    inventory, fits = inventory_of_hf_model(planned_model(module)), {}
    ranked = lambda auto, budget: rank_layouts(inventory, WORLD, LONG, auto, budget,  # noqa: E731
                                               precision="32-true", gpus_per_node=WORLD, fits=fits)
    without = ranked(AutoLayout(LONG, 1, 1e12, context_parallel=(1,)), 1e12)
    budget = min(r.bytes["total"] for r in without) / 0.8 * 0.999  # no layout without cp fits
    assert not ranked(AutoLayout(LONG, 1, budget, context_parallel=(1,)), budget)
    best = ranked(AutoLayout(LONG, 1, budget), budget)[0]
    assert best.layout.cp > 1 and best.bytes["total"] <= 0.8 * budget
    trainer = SimpleNamespace(callbacks=[], precision="32-true")
    import lightning_seqpar.lightning.auto_layout as auto_layout

    plan, auto_layout.rank_layouts = auto_layout.rank_layouts, lambda *a, **k: plan(*a, **{**k, "fits": fits})
    try:
        choice = choose_layout(AutoLayout(LONG, 1, budget, cp_comm="ring"), module, trainer, Layout(),
                               world=WORLD, gpus_per_node=WORLD, device=torch.device("cpu"),
                               sharded_context=contextlib.nullcontext)
    finally:
        auto_layout.rank_layouts = plan
    assert (choice.layout.tp, choice.layout.cp, choice.layout.cp_comm) == (best.layout.tp, best.layout.cp, "ring")
    assert choice.layout.dims(WORLD).dp == WORLD // (best.layout.tp * best.layout.cp * best.layout.pp)


def test_context_parallel_options_are_checked_when_given():
    with pytest.raises(ValueError, match=r"context_parallel=\(0,\): positive sizes"):
        AutoLayout(8, 4, context_parallel=(0,))
    with pytest.raises(ValueError, match="cp_comm='allgather': 'ring' or 'all_to_all'"):
        AutoLayout(8, 4, cp_comm="allgather")
    with pytest.raises(ValueError, match=r"chooses cp; got cp=2 .*context_parallel=\(2,\)"):
        auto_layout_of(AutoLayout(8, 4), 1, 1, cp=2)
    assert auto_layout_of(dict(seq_len=8, batch_size=4, context_parallel=[1, 2]), 1, 1).context_parallel == (1, 2)


def _choose(module, auto, fits, compiled, world=WORLD):
    import lightning_seqpar.lightning.auto_layout as auto_layout

    plan, auto_layout.rank_layouts = auto_layout.rank_layouts, lambda *a, **k: plan(*a, **{**k, "fits": fits})
    try:
        return choose_layout(auto, module, SimpleNamespace(callbacks=[], precision="32-true"), Layout(),
                             world=world, gpus_per_node=world, device=torch.device("cpu"),
                             sharded_context=contextlib.nullcontext, compiled=compiled)
    finally:
        auto_layout.rank_layouts = plan


def test_a_zero_bubble_schedule_is_chosen_where_it_is_best_but_not_for_compiled_blocks():
    module = GPTLightningModule(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=16))
    inventory, fits = inventory_of_hf_model(planned_model(module)), {}
    ranked = lambda budget: rank_layouts(inventory, WORLD, 8, AutoLayout(8, 4, budget, context_parallel=(1,)),  # noqa: E731
                                         budget, precision="32-true", gpus_per_node=WORLD, fits=fits)
    budget = next(b for b in sorted({r.bytes["total"] / 0.8 * 1.0001 for r in ranked(1e12)})
                  if ranked(b)[0].layout.schedule == "ZB-H1")
    auto = AutoLayout(8, 4, budget, context_parallel=(1,))
    chosen = _choose(module, auto, fits, compiled=False)
    assert chosen.record.layout.schedule == chosen.layout.pipeline.schedule == "ZB-H1" and chosen.layout.pipeline.pp > 1
    compiled = _choose(module, auto, fits, compiled=True)  # a compiled block's backward is one graph: no W to split
    assert compiled.layout.pipeline.schedule != "ZB-H1" and compiled.record.layout.schedule != "ZB-H1"
    with pytest.raises(ValueError, match="schedules=\\('gpipe',\\): some of '1F1B', 'ZB-H1', 'ZB-V', 'DualPipeV'"):
        AutoLayout(8, 4, schedules=("gpipe",))


def test_a_lora_model_is_planned_with_its_adapters_trained_and_its_base_frozen():
    from peft import LoraConfig, get_peft_model

    from tests.helpers.models import build

    module = build("hf", layers=4, kv_heads=4, labels=True)
    module.model = get_peft_model(module.model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    inventory, fits = inventory_of_hf_model(planned_model(module)), {}
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert inventory.num_trainable == trained
    assert sum(e.numel for e in inventory.entries) == sum(p.numel() for p in module.parameters())
    auto = AutoLayout(8, 4, 1e12, context_parallel=(1,))
    choice = _choose(module, auto, fits, compiled=False)
    ranked = rank_layouts(inventory, WORLD, 8, auto, 1e12, precision="32-true", gpus_per_node=WORLD, fits=fits)
    assert choice.record.bytes == ranked[0].bytes and choice.layout == ranked[0].layout
    whole = next(r for r in ranked if (r.layout.tp, r.layout.pp, r.layout.zero) == (1, 1, 0))  # every adapter whole
    assert whole.bytes["gradients"] == 4 * trained  # float32 gradients of the adapters only


def test_memory_choices_let_a_layout_fit_by_offload_and_the_run_gets_the_callbacks_it_was_priced_with():
    from lightning_seqpar import ActivationOffload, SelectiveRecompute
    from tests.helpers.models import build

    module, s, world = build("hf", layers=4, kv_heads=4, labels=True), 64, 2  # 2 ranks: fewer layouts to trade
    inventory, fits = inventory_of_hf_model(planned_model(module)), {}
    ranked = lambda budget, trades: rank_layouts(  # noqa: E731
        inventory, world, s, AutoLayout(s, 4, budget, context_parallel=(1,)), budget, precision="32-true",
        gpus_per_node=world, fits=fits, memory_choices=trades)
    budget = min(r.bytes["total"] for r in ranked(1e12, False)) / 0.8 * 0.999  # nothing fits as it is
    assert not ranked(budget, False)
    best = ranked(budget, True)[0]
    assert best.layout.offload or best.layout.recompute_modules
    auto = AutoLayout(s, 4, budget, context_parallel=(1,), memory_choices=True)
    choice = _choose(module, auto, fits, compiled=False, world=world)
    assert choice.layout == best.layout and (best.layout.recompute_modules or best.layout.offload)
    trainer = SimpleNamespace(callbacks=[])
    layout = layout_of_run(choice.layout, trainer, chosen=True)
    offloads = [c for c in trainer.callbacks if isinstance(c, ActivationOffload)]
    recomputes = [c for c in trainer.callbacks if isinstance(c, SelectiveRecompute)]
    assert [c.modules for c in offloads] == ([list(best.layout.offload)] if best.layout.offload else [])
    assert bool(recomputes) == bool(best.layout.recompute_modules or best.layout.recompute != "none")
    again = layout_of_run(choice.layout, trainer, chosen=True)  # the launching process, then a rank: added once
    assert len(trainer.callbacks) == len(offloads) + len(recomputes) and again == layout == choice.layout


def test_the_run_s_loss_chunk_is_priced_and_the_reference_gpt_s_loss_is_whole():
    # A Hugging Face model's head and loss are rewritten, and compute the logits loss_chunk positions at a time; the
    # reference GPT's own loss computes them whole, whatever the strategy's loss_chunk says.
    from lightning_seqpar.lightning.auto_layout import planned_loss_chunk
    from tests.helpers.models import build

    layout = Layout(loss_chunk=1024)
    assert planned_loss_chunk(build("hf"), layout) == 1024
    assert planned_loss_chunk(build("gpt"), layout) is None


def test_loss_chunks_are_searched_when_asked_and_the_strategy_takes_the_chosen_one():
    # A large vocabulary over short sequences: the loss's [s, v] logits make the peak, so a memory between what the
    # whole logits and what chunks of 8 positions need is met only by the chunked loss.
    import lightning.pytorch as pl
    import transformers

    module = pl.LightningModule()
    module.model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    inventory, fits = inventory_of_hf_model(planned_model(module)), {}
    ranked = lambda auto, chunk, budget: rank_layouts(  # noqa: E731
        inventory, WORLD, 64, auto, budget, precision="32-true", gpus_per_node=WORLD, fits=fits, loss_chunk=chunk)
    whole = min(r.bytes["total"] for r in ranked(AutoLayout(64, 4, 1e12), None, 1e12))
    chunked = min(r.bytes["total"] for r in ranked(AutoLayout(64, 4, 1e12), 8, 1e12))
    assert chunked < whole
    budget = (chunked + whole) / 2 / 0.8
    assert not ranked(AutoLayout(64, 4, budget), None, budget)  # nothing fits with the whole logits
    auto = AutoLayout(64, 4, budget, loss_chunks=(None, 8))
    choice = _choose(module, auto, fits, compiled=False)
    assert choice.record.layout.loss_chunk == choice.layout.loss_chunk == 8
    with pytest.raises(ValueError, match=r"AutoLayout.loss_chunks=\(0,\): positive numbers of positions"):
        AutoLayout(64, 4, loss_chunks=(0,))


def test_a_pretrained_module_built_in_configure_model_is_planned_before_it_has_a_trainer(tmp_path):
    """What the launching process does for strategy=auto: the module's declared model (built on the meta device, no
    weight read), not its configure_model, which needs the trainer (was: "... is not attached to a Trainer")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_seqpar.models.finetune import FineTuneModule

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    module = FineTuneModule(str(tmp_path / "model"), {"r": 2, "target_modules": ["q_proj", "v_proj"]})  # LoRA
    trainer = SimpleNamespace(callbacks=[], precision="32-true")
    choice = choose_layout(AutoLayout(32, 2, 1e9), module, trainer, Layout(), world=2, gpus_per_node=2,
                           device=torch.device("cpu"), sharded_context=lambda: torch.device("meta"))
    assert choice.record.feasible and choice.layout.tp * choice.layout.pipeline.pp * choice.record.dp == 2
    assert not hasattr(module, "model")  # the module is left as given: its ranks build it


def test_a_run_launched_again_reads_the_probes_its_first_launch_kept(tmp_path, monkeypatch):
    import lightning_seqpar.plan.measuring.probe as probe

    module = GPTLightningModule(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=16))
    auto = AutoLayout(8, 4, 1e12, context_parallel=(1,), schedules=("1F1B",), cache=str(tmp_path))

    def choose():
        return choose_layout(auto, module, SimpleNamespace(callbacks=[], precision="32-true"), Layout(),
                             world=2, gpus_per_node=2, device=torch.device("cpu"),
                             sharded_context=contextlib.nullcontext)

    first = choose()
    kept = sorted(path.name for path in tmp_path.iterdir())
    assert kept  # the first launch probed and kept its fits

    def measured(*args, **kwargs):
        raise AssertionError("a probe was measured again")

    monkeypatch.setattr(probe, "measure", measured)
    again = choose()
    assert again.record == first.record and sorted(path.name for path in tmp_path.iterdir()) == kept
    assert AutoLayout(8, 4, 1e12, cache=False).fits() == {}
    with pytest.raises(ValueError, match="AutoLayout.cache=3"):
        AutoLayout(8, 4, 1e12, cache=3)
