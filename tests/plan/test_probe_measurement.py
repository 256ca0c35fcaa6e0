"""How the planner's probes are measured, made fast without changing what they measure:

- one rank with mirrored peers keeps for backward what rank 0 of t emulated ranks (threads, each running the model)
  keeps, byte for byte;
- a small model copied from one built earlier gives the fits a fresh build gives;
- probes measured in worker processes give the fits this process gives."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_seqpar.hf.model_check import parts_in_order
from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules
from lightning_seqpar.memory.tracker import LiveActivationTracker
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.parallel.mirrored import MirroredGroup
from lightning_seqpar.plan import model_inventory
from lightning_seqpar.plan.measuring.probe import (
    _DTYPES, _PROBES, PROBES_PER_FIT, fit_layer, fit_outside, measure, probe_input, probe_model,
    split_changes_what_is_kept,
)
from lightning_seqpar.plan.measuring.probe_models import ProbeModels
from lightning_seqpar.plan.measuring.probe_pool import KEY, ProbePool, probe_pool

pytestmark = pytest.mark.slow  # the planner's probes: the full suite runs it, the fast lane does not

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
MODELS = {
    "llama + LoRA": (dict(SIZES, model_type="llama"), 4),
    "qwen3-moe": (dict(SIZES, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[]), None),
    "gpt2": (dict(model_type="gpt2", vocab_size=64, n_embd=64, n_head=8, n_layer=4, n_positions=4096), None),
}


def _inventory(name):
    config, lora = MODELS[name]
    return model_inventory(config, lora=lora)


def _emulated(inventory, tp, recompute, precision, split, s, b):
    """What :func:`measure` keeps on rank 0, measured the way it was before mirrored peers: t threads, each rank
    building and running its own model, rank 0's tracked."""
    small, x = probe_input(inventory.config, tp, s, b)

    def one_rank(group):
        model = probe_model(small, _DTYPES[precision], group, True, recompute, training=inventory.training,
                            split=split)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
        if group.rank != 0:
            with autocast:
                model(input_ids=x, labels=x)
            return None
        parts = parts_in_order(model)
        with autocast, LiveActivationTracker(model) as tracker:
            out = model(input_ids=x, labels=x)
        kept = (tracker.live_bytes(parts[2]), tracker.live_bytes(parts[1]), tracker.live_bytes())
        del out
        return kept

    if precision != "bf16-mixed":
        return run_emulated(tp, one_rank)[0]
    with cuda_autocast_rules():
        return run_emulated(tp, one_rank)[0]


@pytest.mark.parametrize("name, tp, recompute, precision, split", [
    ("llama + LoRA", 2, "none", "bf16-mixed", False), ("llama + LoRA", 4, "selective", "bf16-true", True),
    ("qwen3-moe", 2, "selective", "bf16-mixed", False), ("gpt2", 2, "full", "32-true", False),
    ("gpt2", 4, "none", "bf16-mixed", True),
])
def test_one_rank_with_mirrored_peers_keeps_what_rank_0_of_emulated_ranks_keeps(name, tp, recompute, precision,
                                                                                 split):
    inventory = _inventory(name)
    s, b = 8 * tp, 2
    layer, first, everything = _emulated(inventory, tp, recompute, precision, split, s, b)
    probed = measure(inventory.config, tp, True, recompute, precision, s, b, training=inventory.training, split=split)
    assert (probed.layer, probed.first) == (layer, first)
    # The emulated threads leave the last collective's tensors in their exchange (one rank's [b·s] loss terms per
    # peer), which no real group keeps: the whole forward differs by that alone.
    assert 0 <= everything - probed.everything <= 4 * b * s * (tp - 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_split_backward_keeps_what_the_whole_one_keeps_where_its_probes_are_shared(name):
    inventory = _inventory(name)
    shared = [(tp, recompute, precision) for tp in (1, 2) for recompute in ("none", "selective", "full")
              for precision in ("bf16-true", "bf16-mixed", "32-true")
              if not split_changes_what_is_kept(precision, recompute)]
    assert len(shared) == 8  # bf16-true under each recomputation, bf16-mixed under full
    for tp, recompute, precision in shared:
        whole, split = (measure(inventory.config, tp, True, recompute, precision, 8 * tp, 2,
                                training=inventory.training, split=split) for split in (False, True))
        assert whole == split, (tp, recompute, precision)


@pytest.mark.parametrize("name", ["llama + LoRA", "qwen3-moe"])
def test_fits_from_copied_models_equal_fits_from_fresh_builds(name):
    inventory = _inventory(name)
    measured: dict = {}
    for recompute, precision, options in (("none", "bf16-mixed", {}), ("selective", "bf16-mixed", dict(split=True)),
                                          ("none", "bf16-mixed", dict(modules=("mlp",) if name != "qwen3-moe" else
                                                                      ("moe",), offload=("attn_norm",))),
                                          ("full", "bf16-mixed", {}), ("none", "32-true", {})):
        # (after the first, each copies the rewritten small models the first of its precision built)
        kept = fit_layer(inventory.config, 2, True, recompute, precision, inventory.experts,
                         training=inventory.training, measured=measured, **options)
        fresh = fit_layer(inventory.config, 2, True, recompute, precision, inventory.experts,
                          training=inventory.training, **options)
        assert kept == fresh, (recompute, precision, options)
    # one model per width of the probes (d, f, v: a probe's b and s are its input's), built once: bf16-mixed and
    # 32-true both hold float32 weights
    assert len(measured[("probe models",)]._held) == len({(d, f, v) for _, _, d, f, v in _PROBES})


def test_the_most_recently_used_models_are_kept_and_copies_are_handed_out():
    inventory = _inventory("gpt2")
    models = ProbeModels(most=2)
    configs = [probe_input(inventory.config, 1, 8, 1, dict(vocab_size=v))[0] for v in (64, 96, 128)]

    def rewritten(config):
        return models.rewritten(config, None, torch.float32, MirroredGroup(2), True)

    first = rewritten(configs[0])
    rewritten(configs[1])
    rewritten(configs[0])  # used again: kept over configs[1] when a third arrives
    rewritten(configs[2])
    assert [model.config.vocab_size for model, _ in models._held.values()] == [64, 128]
    again = rewritten(configs[0])
    assert again is not first and all(torch.equal(a, b) for a, b in zip(again.parameters(), first.parameters()))
    sent = pickle.loads(pickle.dumps(models))  # (a probes' cache sent to spawned ranks): the models stay here
    assert sent.most == 2 and not sent._held and len(models._held) == 2


def test_probes_measured_by_worker_processes_give_this_process_s_fits():
    inventory = _inventory("qwen3-moe")
    measured: dict = {}
    with probe_pool(measured, 2, PROBES_PER_FIT) as pool:
        assert isinstance(pool, ProbePool) and measured[KEY] is pool
        layer = fit_layer(inventory.config, 2, True, "selective", "bf16-mixed", inventory.experts, measured=measured)
        outside = fit_outside(inventory.config, 2, True, "bf16-mixed", recompute="selective",
                              experts=inventory.experts, measured=measured)
        with pytest.raises(ValueError, match="granularity"):  # a worker's error reaches the caller
            fit_layer(inventory.config, 2, True, "everything", "32-true", inventory.experts, measured=measured)
    assert KEY not in measured  # the workers stopped with the block
    assert layer == fit_layer(inventory.config, 2, True, "selective", "bf16-mixed", inventory.experts)
    assert outside == fit_outside(inventory.config, 2, True, "bf16-mixed", recompute="selective",
                                  experts=inventory.experts)
    with probe_pool(measured, 1, PROBES_PER_FIT) as none:  # one worker: this process measures
        assert none is None and KEY not in measured
