"""The planner's probes of a model with learned positions shorter than a probe's sequence (the reference GPT at a
small ``block_size``, planned as GPT-2) measure instead of failing on a position out of range."""

from lightning_seqpar.plan.measuring.models import meta_model
from lightning_seqpar.plan.measuring.probe import fit_outside, measure


def test_probes_longer_than_the_learned_positions_measure():
    config = meta_model(dict(model_type="gpt2", vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4)).config
    fit = fit_outside(config, 2, True, "32-true")  # its probes reach s = 48 > 32 positions
    assert fit.check_error < 0.05
    layer, everything, _, _ = measure(config, 2, True, "none", "32-true", 64, 1)
    assert 0 < layer < everything
