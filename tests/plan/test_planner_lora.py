"""The planner prices LoRA and partly frozen full fine-tuning (``--lora R``, ``--frozen NAME``): the frozen base
holds its parameters only, the trained elements carry gradients and optimizer state. Checked against PEFT's own
count for Llama-3-8B at r 16 and against the byte formulas on the command line's records. Under LoRA the zero-bubble
schedules defer the adapters' weight gradients to W, priced with their small share; with every split weight frozen
they are refused: nothing is left for W."""

from __future__ import annotations

import json

import pytest

from lightning_seqpar.plan import Hardware, model_inventory, plan
from lightning_seqpar.plan.__main__ import main
from tests.plan.test_planner import LLAMA3_8B, PUBLISHED

BASE = PUBLISHED["llama3-8b"][1]
# r·(in + out) per adapted projection, 32 layers: q, o 4096→4096; k, v 4096→1024; gate, up, down 4096↔14336
LORA_16 = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
EMBEDDINGS = 2 * 128256 * 4096  # embed_tokens and the untied lm_head


def test_lora_and_frozen_parts_are_counted_as_peft_and_torch_count_them():
    lora = model_inventory(LLAMA3_8B, lora=16)
    assert lora.num_trainable == LORA_16 == 41_943_040  # what PEFT prints for Llama-3-8B at r 16 on every projection
    assert lora.num_parameters == BASE + LORA_16
    frozen = model_inventory(LLAMA3_8B, frozen=("embed_tokens", "lm_head"))
    assert frozen.num_parameters == BASE and frozen.num_trainable == BASE - EMBEDDINGS


def _records(tmp_path, capsys, *flags):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--json", "--analytic",
                 "--cp", "1", "--precision", "32-true", *flags]) == 0
    records = json.loads(capsys.readouterr().out)
    return next(r for r in records if r["bytes"] and [r["layout"][k] for k in ("tp", "pp", "zero")] == [1, 1, 0])


TENSORS = 32 * 9 + 3  # a layer's 7 projections and 2 norms; the embedding, the final norm, the head


@pytest.mark.slow  # the planner's probes: outside the fast lane
@pytest.mark.parametrize("flags, total, trained, tensors", [
    (("--lora", "16"), BASE + LORA_16, LORA_16, 32 * 7 * 2),  # an A and a B per adapted projection
    (("--frozen", "embed_tokens", "lm_head"), BASE, BASE - EMBEDDINGS, TENSORS - 2),
    ((), BASE, BASE, TENSORS)])
def test_the_command_line_prices_the_trained_elements_only(tmp_path, capsys, flags, total, trained, tensors):
    record = _records(tmp_path, capsys, *flags)  # float32 weights, gradients; AdamW's float32 moments and step
    assert record["bytes"]["parameters"] == 4 * total
    assert record["bytes"]["gradients"] == 4 * trained
    assert record["bytes"]["optimizer"] == 8 * trained + 4 * tensors


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_the_header_says_what_is_trained(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic", "--cp", "1",
          "--top", "1", "--lora", "16"])
    assert "+ LoRA r=16: 8.07 B parameters (41.9 M trainable)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (("--lora", "16", "--frozen", "lm_head"), r"frozen=\['lm_head'\] with LoRA: LoRA trains the adapters only"),
    (("--lora", "16", "--lora-targets", "c_attn"), r"LoRA target_modules \['c_attn'\] match no module.*q_proj"),
    (("--frozen", "router"), "frozen 'router' names no parameter"),
    (("--lora", "0"), "--lora"),
])
def test_bad_fine_tuning_flags_are_refused_naming_the_value(tmp_path, capsys, flags, message):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic", *flags])
    assert exit.value.code == 2
    import re

    assert re.search(message, capsys.readouterr().err, re.S)


def test_lora_s_adapters_are_w_and_zero_bubble_schedules_are_priced_with_their_small_share():
    # The split backward defers LoRA's adapters' weight gradients to W (its frozen base has none): W is r-sized, so
    # ZB-V still gains from its V (a shorter warm-up) but far less than when every weight trains, and W holds the
    # adapted projections' inputs and output gradients plus the adapters' rank-r tensors.
    from lightning_seqpar.pipeline_parallel.schedules import bubble_fraction
    from lightning_seqpar.plan.pricing.activations import weight_gradient_bytes

    small = dict(LLAMA3_8B, num_hidden_layers=4)
    full, lora = model_inventory(small), model_inventory(small, lora=16)
    nothing = model_inventory(small, frozen=["_proj"])  # every projection frozen: only norms train
    assert sum(e.deferred for e in full.entries) == 4 * 7 and sum(e.deferred for e in lora.entries) == 4 * 7 * 2
    assert full.weight_gradient_share == 1.0 and 0 < lora.weight_gradient_share < 0.01
    assert not any(e.deferred for e in nothing.entries) and nothing.weight_gradient_share == 0.0
    h, r = LLAMA3_8B["hidden_size"], 16
    # the same projections' inputs and output gradients, and 2r per adapter (t = 1): A's output gradient, B's input
    assert weight_gradient_bytes(lora, 2048, 1, 1) - weight_gradient_bytes(full, 2048, 1, 1) == 2 * 2048 * 7 * 2 * r
    only_qv = model_inventory(small, lora=r, lora_targets=["q_proj", "v_proj"])
    a, g, d = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"], h // LLAMA3_8B["num_attention_heads"]
    assert weight_gradient_bytes(only_qv, 2048, 1, 2) == 2 * 2048 * (h / 2 + a * d / 2 + g * d / 2 + 2 * (r / 2 + r))
    options = dict(hardware=Hardware(memory=1e12), calibrate=False, schedule=("1F1B", "ZB-H1", "ZB-V"))
    records = {(x.layout.schedule, x.layout.pp, x.layout.tp, x.micro_batch): x
               for x in plan(lora, 8, 2048, 16, **options) if x.feasible}
    zb_v = [x for key, x in records.items() if key[0] == "ZB-V"]
    assert zb_v
    for x in zb_v:
        w = lora.weight_gradient_share
        again = 1.0 if x.layout.recompute == "full" else 0.0  # full recomputation's B makes the forward again first
        idle = bubble_fraction("ZB-V", x.layout.num_microbatches, x.layout.pp, costs=(1.0, 2.0 - w + again, w))
        assert x.bubble == idle / (1 - idle)
        equal = bubble_fraction("ZB-V", x.layout.num_microbatches, x.layout.pp)
        one = records.get(("1F1B", x.layout.pp, x.layout.tp, x.micro_batch))
        assert equal / (1 - equal) < x.bubble < (one.bubble if one is not None else 1.0)
    refused = plan(nothing, 8, 2048, 16, **options)
    assert not {"ZB-H1", "ZB-V"} & {x.layout.schedule for x in refused if x.feasible}
    assert any(x.reason == f"schedule={s} with no trained weight to defer to W (the split layers' weights are frozen), "
                           f"so W fills no bubble" for x in refused for s in ("ZB-H1", "ZB-V"))


TINY = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_the_probes_train_the_model_as_the_run_does():
    # The run's LoRA settings and frozen names are copied onto the probes' small model: the same parameters train.
    import transformers

    from lightning_seqpar.hf.models import build_causal_lm
    from lightning_seqpar.plan.measuring.models import freeze, meta_model, with_lora
    from lightning_seqpar.plan.measuring.trained import apply_trained_parts, generic_name

    assert generic_name("base_model.model.model.layers.11.mlp.experts.3.w1") == \
        "base_model.model.model.layers.#.mlp.experts.#.w1"
    assert model_inventory(TINY).training is None  # every parameter trained: the probes' default (their old key)
    lora = model_inventory(TINY, lora=4, lora_targets=["q_proj", "v_proj"])
    frozen = model_inventory(TINY, frozen=("embed_tokens", "mlp"))
    assert lora.training.lora.r == 4 and lora.training.lora.target_modules == {"q_proj", "v_proj"}
    assert frozen.training.lora is None and "model.layers.#.mlp.down_proj.weight" in frozen.training.frozen
    assert len({model_inventory(TINY).probe_key, lora.probe_key, frozen.probe_key}) == 3  # no fit shared
    partly_frozen = meta_model(TINY)
    freeze(partly_frozen, ("embed_tokens", "mlp"))
    small = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3, "hidden_size": 16})
    for inventory, run in ((lora, with_lora(meta_model(TINY), 4, ["q_proj", "v_proj"])), (frozen, partly_frozen)):
        probe = apply_trained_parts(build_causal_lm(small), inventory.training)
        trained = {generic_name(n) for n, p in probe.named_parameters() if p.requires_grad}
        expected = {generic_name(n) for n, p in run.named_parameters() if p.requires_grad}
        assert trained == expected != set()


@pytest.mark.slow  # the planner's probes: outside the fast lane
def test_a_frozen_base_keeps_less_and_its_fit_stays_exact():
    # A frozen projection keeps no input for a weight gradient: the LoRA layer keeps less than the trained one, and
    # an adapter's [b, s, r] rows (r fixed) are a b·s term, so the fit still predicts a size no probe used.
    # The first layer, whose input (the frozen embedding's output) needs no gradient, keeps less again: fitted apart.
    from lightning_seqpar.plan.measuring.probe import fit_layer, measure, measure_layer

    lora = model_inventory(TINY, lora=4, lora_targets=["q_proj", "v_proj"])
    config, parts = lora.config, lora.training
    s, b, d = 48, 2, 24
    overrides = dict(head_dim=d, hidden_size=4 * d, intermediate_size=80)
    trained = measure_layer(config, 2, True, "none", "32-true", s, b, overrides)
    measured = measure(config, 2, True, "none", "32-true", s, b, overrides, training=parts)
    assert measured.layer < 0.9 * trained and measured.first < measured.layer
    fit = fit_layer(config, 2, True, "none", "32-true", training=parts)
    predicted = fit.bytes(s, b, d, 80)
    assert abs(predicted - measured.layer) <= 0.01 * measured.layer, (predicted, measured)
    saving = fit.first_layer_saving(s, b, d, 80)
    assert abs(saving - (measured.layer - measured.first)) <= 0.01 * measured.layer, (saving, measured)
    assert fit_layer(config, 2, True, "none", "32-true").first is None  # all trained: one fit serves every layer


def test_only_trained_parameters_accumulate_a_grad():
    # With gradient accumulation the `.grad` beside the buckets is the trained parameters' (the adapters'), and the
    # largest weight gradient a backward makes is a trained one's: LoRA's frozen base makes neither.
    from lightning_seqpar.plan.pricing.state import state_bytes
    from lightning_seqpar.plan.pricing.transients import largest_layer_weight

    lora = model_inventory(TINY, lora=4, lora_targets=["q_proj", "v_proj"])
    state = state_bytes(lora, 1, dp=2, precision="32-true")
    assert state.trained == 4 * lora.num_trainable < state.parameters
    adapter = max(e.numel for e in lora.entries if e.trainable and e.part == "layer")
    assert largest_layer_weight(lora, 1) == 2 * adapter  # (gated MLP's factor 2)
    options = dict(hardware=Hardware(memory=1e12), calibrate=False, micro_batches=(1,), context_parallel=(1,),
                   precision="32-true")
    record = next(r for r in plan(lora, 2, 32, 4, **options)
                  if r.feasible and (r.layout.tp, r.dp, r.layout.zero) == (1, 2, 0))
    assert record.other["accumulated_gradients"] == state.trained


def test_frozen_weights_make_no_weight_gradient_gemm_and_the_step_s_flops_say_so():
    # Eq. 8 counts forward, input-gradient and weight-gradient GEMMs; a frozen matrix runs the first two only
    layers = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # q, o; k, v; gate, up, down
    head = 128256 * 4096  # the untied head (the embedding is a lookup: no GEMM)
    tokens = 32 * 4096
    kwargs = dict(calibrate=False, context_parallel=(1,), micro_batches=(1,), precision="32-true")
    full = plan(model_inventory(LLAMA3_8B), 8, 4096, 32, **kwargs)
    lora = plan(model_inventory(LLAMA3_8B, lora=16), 8, 4096, 32, **kwargs)
    frozen = plan(model_inventory(LLAMA3_8B, frozen=("embed_tokens", "lm_head")), 8, 4096, 32, **kwargs)
    for records, skipped in ((lora, layers + head), (frozen, head)):
        for record in records[:3]:
            same = next(r for r in full if (r.layout, r.dp, r.micro_batch) == (record.layout, record.dp,
                                                                                record.micro_batch))
            assert same.flops["hardware"] - record.flops["hardware"] == 2 * tokens * skipped
            assert same.flops["model"] == record.flops["model"]


def test_lora_on_the_experts_is_counted_as_peft_counts_it_and_split_with_the_experts():
    """``--lora 16 --lora-experts`` on Qwen3-30B-A3B: PEFT's ``target_parameters`` adapters on both packed projections
    of 128 experts in 48 layers, beside q/k/v/o; per rank the experts' A and B split over ep with their experts, and B
    of gate/up and A of down along the width over expert_tp too."""
    from lightning_seqpar.plan import state_bytes
    from lightning_seqpar.plan.measuring.models import load_model_config, meta_model, with_lora
    from tests.plan.test_planner_experts import QWEN3_30B_A3B

    attention_targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    inventory = model_inventory(QWEN3_30B_A3B, lora=16, lora_targets=attention_targets, lora_experts=True)
    h, f, experts, r, layers = 2048, 768, 128, 16, 48
    attention = layers * r * ((h + 4096) + 2 * (h + 512) + (4096 + h))  # q, k, v, o
    a_gate_up, b_gate_up, a_down, b_down = r * experts * h, 2 * f * r * experts, r * experts * f, h * r * experts
    assert inventory.num_trainable == attention + layers * (a_gate_up + b_gate_up + a_down + b_down)
    peft_model = with_lora(meta_model(load_model_config(QWEN3_30B_A3B)), 16, attention_targets, experts=True)
    assert inventory.num_trainable == peft_model.get_nb_trainable_parameters()[0]  # PEFT's own count
    for ep, etp in ((8, 1), (4, 2)):  # tp 1 · dp 8: float32 gradients of the trained elements this rank holds
        got = state_bytes(inventory, 1, 1, 8, ep=ep, expert_tp=etp, precision="32-true")
        per_layer = (a_gate_up + b_down) // ep + (b_gate_up + a_down) // (ep * etp)
        assert got.gradients == 4 * (attention + layers * per_layer), (ep, etp)
        assert got.optimizer - got.steps == 2 * 4 * (attention + layers * per_layer)  # AdamW's two float32 moments
    with pytest.raises(ValueError, match="has no mixture of experts"):
        model_inventory(LLAMA3_8B, lora=16, lora_experts=True)


def test_lora_experts_without_a_rank_is_refused_on_the_command_line(tmp_path, capsys):
    from tests.plan.test_planner_experts import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--gpus", "8", "--seq-len", "4096", "--global-batch", "32", "--analytic", "--no-cache",
              "--lora-experts"])
    assert "--lora-experts) needs a LoRA rank: give --lora R too" in capsys.readouterr().err
