"""What a checkpoint must pass before anything loads from it, one check at a time."""

import pytest
import torch
import torch.nn as nn

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.checkpoint.checks import (
    check_finite,
    check_optimizer_state,
    check_state_dict_shapes,
    on_every_rank,
    optimizer_states_of_this_stage,
)
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup

CONFIG = GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=4, n_embd=16)


def _rewritten():
    root = nn.Module()
    root.gpt = GPT(CONFIG)
    rewrite(root, RewriteContext(ParallelGroup.virtual(2), True, None, True))
    return root


def test_a_single_device_state_dict_fits_the_sharded_model_and_another_width_does_not():
    model = _rewritten()
    plain = nn.Module()
    plain.gpt = GPT(CONFIG)
    check_state_dict_shapes(model, plain.state_dict())  # full shapes, no vocabulary padding: fits
    wide = nn.Module()
    wide.gpt = GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=4, n_embd=32))
    with pytest.raises(ValueError, match="'gpt.transformer.wte.weight': checkpoint \\(13, 32\\), model \\(13, 16\\)"):
        check_state_dict_shapes(model, wide.state_dict())


def test_non_finite_values_are_named_with_their_key():
    check_finite({"a": torch.ones(3), "steps": [torch.tensor(1)]}, "weight")
    with pytest.raises(ValueError, match="optimizer state 0 'state.2.exp_avg_sq' holds 2 non-finite value\\(s\\)"):
        check_finite({"state": {2: {"exp_avg_sq": torch.tensor([1.0, float("inf"), float("nan")])}}}, "optimizer state 0")


def test_optimizer_states_of_another_model_or_layout_are_refused():
    params = [nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params)
    good = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 2)}}, "param_groups": [{"params": [0, 1]}]}
    check_optimizer_state(optimizer, good, "optimizer state 0")
    with pytest.raises(ValueError, match="holds \\[3\\] parameters per group; this run's optimizer has \\[2\\]"):
        check_optimizer_state(optimizer, {**good, "param_groups": [{"params": [0, 1, 2]}]}, "optimizer state 0")
    wrong = {"state": {0: {"exp_avg": torch.zeros(5, 2)}}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match="entry 0.exp_avg has shape \\(5, 2\\); its parameter has \\(4, 2\\)"):
        check_optimizer_state(optimizer, wrong, "optimizer state 0")
    with pytest.raises(ValueError, match="saved with pp=1; this run has pp=2"):
        optimizer_states_of_this_stage([good], [optimizer], pp=2, pipeline_rank=0, allow_non_finite=False)
    staged = {"pipeline_stages": [good, good]}
    assert optimizer_states_of_this_stage([staged], [optimizer], pp=2, pipeline_rank=1, allow_non_finite=False) == [good]


def test_without_processes_a_failed_check_is_raised_with_the_rank():
    assert on_every_rank(lambda: 7) == 7

    def fail():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad \\(found on rank 0\\)"):
        on_every_rank(fail)


def test_a_full_checkpoint_resumes_only_into_the_placement_of_layers_that_wrote_it():
    """Its optimizer state is each rank's, in the order of the layers it held: 1F1B's contiguous stages, the interleaved
    loop and ZB-V's V hand the same layers to other ranks, so another placement is refused by name (an older mark,
    ``True``, carries no record)."""
    from lightning_seqpar.checkpoint.checks import check_stage_placement

    one_f_one_b = {"virtual_stages": 1, "placement": "loop", "split": None}
    zb_v = {"virtual_stages": 2, "placement": "V", "split": None}
    check_stage_placement({"stages": dict(one_f_one_b)}, one_f_one_b)
    check_stage_placement(True, zb_v)
    for saved, run in ((one_f_one_b, zb_v), (zb_v, {**zb_v, "placement": "loop"}), (one_f_one_b, {**one_f_one_b,
                                                                                                    "split": [3, 1]})):
        match = r"placed as .* this run places them as .*CheckpointConfig\(format='sharded'\)"
        with pytest.raises(ValueError, match=match):
            check_stage_placement({"stages": saved}, run)
