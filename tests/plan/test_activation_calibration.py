"""The planner's activation bytes per layer against the bytes the rewritten layer keeps, measured at a size none of
the probes used (more tokens, another head width and MLP width, two sequences): 20 layouts over tensor parallelism
with sequence parallelism, recomputation, precision and six families. The signed errors are printed as a table."""

from __future__ import annotations

import pytest

from lightning_seqpar.hf.model_check import probe_head_dim
from lightning_seqpar.plan.measuring.probe import fit_layer, measure_layer

pytestmark = pytest.mark.slow  # the planner's probes: the full suite runs it, the fast lane does not

BOUND = 0.05  # the bound; the fits are exact where the layer is linear in each size
SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3"),  # per-head q/k norms
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=4096),  # four norms, soft-capping
    "phi3": dict(model_type="phi3"),  # fused projections of unequal q/k/v
    "gpt2": dict(model_type="gpt2", n_embd=64, n_head=8, n_layer=4, n_positions=4096),  # biases, learned positions
    "falcon": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=4),  # grouped q/k/v
}
LAYOUTS = [  # (family, tp, recompute, precision)
    ("llama", 1, "none", "32-true"), ("llama", 2, "none", "32-true"), ("llama", 2, "selective", "bf16-true"),
    ("llama", 2, "full", "bf16-mixed"), ("llama", 4, "selective", "bf16-mixed"), ("llama", 2, "none", "bf16-mixed"),
    ("qwen3", 2, "selective", "bf16-mixed"), ("qwen3", 2, "none", "32-true"),
    ("gemma2", 2, "none", "bf16-true"), ("gemma2", 2, "selective", "32-true"),
    ("phi3", 2, "selective", "bf16-mixed"), ("phi3", 2, "none", "bf16-true"), ("phi3", 1, "selective", "32-true"),
    ("gpt2", 2, "none", "bf16-mixed"), ("gpt2", 2, "selective", "32-true"), ("gpt2", 4, "full", "32-true"),
    ("falcon", 2, "none", "bf16-mixed"), ("falcon", 2, "selective", "bf16-true"),
    ("llama", 4, "none", "32-true"), ("qwen3", 4, "full", "bf16-true"),
]


def _config(family):
    import transformers

    options = {**SIZES, **FAMILIES[family]}
    return transformers.AutoConfig.for_model(options.pop("model_type"), attn_implementation="eager", **options)


@pytest.fixture(scope="module")
def errors():
    rows = []
    for family, tp, recompute, precision in LAYOUTS:
        config = _config(family)
        fit = fit_layer(config, tp, True, recompute, precision)
        heads = config.num_attention_heads
        s, b, d, f = 24 * tp, 2, 3 * probe_head_dim(config), 40 * tp
        overrides = dict(head_dim=d, hidden_size=heads * d, n_embd=heads * d, intermediate_size=f, n_inner=f,
                         ffn_hidden_size=f)
        measured = measure_layer(config, tp, True, recompute, precision, s, b, overrides)
        rows.append((family, tp, recompute, precision, measured, fit.bytes(s, b, d, f)))
    print("\n| family | tp | recompute | precision | measured bytes | predicted | signed error |\n|---|---|---|---|---|---|---|")
    for family, tp, recompute, precision, measured, predicted in rows:
        print(f"| {family} | {tp} | {recompute} | {precision} | {measured} | {predicted:.0f} | "
              f"{(predicted - measured) / measured:+.2%} |")
    return rows


def test_every_layout_s_layer_is_predicted_within_the_bound(errors):
    assert len(errors) >= 20
    worst = max(abs(predicted - measured) / measured for *_, measured, predicted in errors)
    assert worst <= BOUND, errors


def test_the_probes_see_what_the_layouts_change():
    # Under the same model, sequence parallelism and recomputation change what a layer keeps, as Table 2 says.
    config = _config("llama")
    s, b, d, f = 32, 1, 8, 64
    overrides = dict(head_dim=d, hidden_size=8 * d, intermediate_size=f)
    none, selective, full = (measure_layer(config, 2, True, r, "32-true", s, b, overrides)
                             for r in ("none", "selective", "full"))
    assert full < selective < none
    assert measure_layer(config, 2, False, "none", "32-true", s, b, overrides) > none  # no SP: whole norm inputs


@pytest.mark.parametrize("family, precision", [("qwen3", "bf16-mixed"), ("gpt2", "bf16-mixed"), ("gemma2", "32-true")])
def test_a_whole_forward_is_its_layers_and_what_lies_outside_them(family, precision):
    # One micro-batch on one stage: what the planner adds up (the probed layer three times, and the probed rest:
    # embedding, final norm, head, loss) against everything the forward keeps, at a size no probe used.
    from lightning_seqpar.plan.measuring.probe import fit_outside, measure

    config, tp = _config(family), 2
    layer, outside = fit_layer(config, tp, True, "none", precision), fit_outside(config, tp, True, precision)
    heads, base = config.num_attention_heads, probe_head_dim(config)
    s, b, d, f, v = 24 * tp, 2, 3 * base, 40 * tp, 1000
    overrides = dict(head_dim=d, hidden_size=heads * d, n_embd=heads * d, intermediate_size=f, n_inner=f,
                     ffn_hidden_size=f, vocab_size=v)
    _, measured, _, _ = measure(config, tp, True, "none", precision, s, b, overrides)
    predicted = 3 * layer.bytes(s, b, d, f) + outside.bytes(s, b, d, v)
    print(f"\n{family} {precision}: whole forward measured {measured}, predicted {predicted:.0f}, "
          f"{(predicted - measured) / measured:+.2%}")
    assert abs(predicted - measured) <= BOUND * measured
