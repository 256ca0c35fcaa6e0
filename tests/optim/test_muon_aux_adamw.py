"""``lightning_seqpar.optim.Muon`` on one process: ``torch.optim.Muon`` beside ``torch.optim.AdamW`` bit for bit, a
mixture's 3-D expert stacks orthogonalised expert by expert (each expert's matrix as torch's Muon takes it)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_seqpar.optim import Muon
from tests.helpers.models import BATCH, token_data
from tests.optim.test_muon_one_optimizer import STEPS, OneMuonLM


def test_one_process_is_torch_muon_beside_torch_adamw_bit_for_bit():
    torch.manual_seed(0)
    module = OneMuonLM("qwen3_moe").double()
    twin = copy.deepcopy(module)
    ours = module.configure_optimizers()
    matrices, rest = (g["params"] for g in Muon.groups(twin.model))
    assert any(p.dim() == 3 for p in Muon.groups(module.model)[0]["params"])  # the experts' stacks are Muon's
    flat = [p for p in matrices if p.dim() == 2]
    stacks = [p for p in matrices if p.dim() == 3]
    theirs = [torch.optim.Muon(flat, lr=2e-3, adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)]
    # torch's Muon takes 2-D parameters only: each expert's matrix as a parameter of its own
    experts = [[torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])] for p in stacks]
    theirs.append(torch.optim.Muon([e for per in experts for e in per], lr=2e-3, adjust_lr_fn="match_rms_adamw"))
    x = token_data(STEPS, 1).tensors[0]
    for step in range(STEPS):
        for model, optimizers in ((module, [ours]), (twin, theirs)):
            for optimizer in optimizers:
                optimizer.zero_grad()
            for p in stacks:  # (held by no optimizer of the twin: their experts are)
                p.grad = None
            model.compute_loss(x[step * BATCH:(step + 1) * BATCH], x[step * BATCH:(step + 1) * BATCH]).backward()
        for p, per in zip(stacks, experts):
            for e, expert in enumerate(per):
                expert.grad = p.grad[e].clone()
        for optimizer in theirs:
            optimizer.step()
        ours.step()
        with torch.no_grad():
            for p, per in zip(stacks, experts):
                p.copy_(torch.stack([e.detach() for e in per]))
    for (name, mine), other in zip(module.named_parameters(), twin.parameters()):
        torch.testing.assert_close(mine, other, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert ours.newton_schulz_runs == STEPS * (len(flat) + sum(p.shape[0] for p in stacks))


def test_a_vector_in_a_muon_group_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"shape \(4,\) is in a use_muon group\. Put it in a group with use_muon="):
        Muon([torch.nn.Parameter(torch.zeros(4))])


def test_the_modules_take_muon_by_name_and_refuse_an_unknown_one():
    from tests.helpers.models import gpt_module

    groups = gpt_module(optimizer="muon").configure_optimizers()["optimizer"].param_groups
    assert [(len(g["params"]), g["use_muon"], g["weight_decay"]) for g in groups] == [
        (8, True, 0.1), (2, False, 0.1), (18, False, 0.0)]  # the layers' matrices; wte (tied head) and wpe; 1-D
    with pytest.raises(ValueError, match=r"optimizer='lion': one of \['adamw', 'muon'\] \(optim.name in the recipes\)"):
        gpt_module(optimizer="lion")
