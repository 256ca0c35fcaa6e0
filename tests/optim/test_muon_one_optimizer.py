"""``lightning_seqpar.optim.Muon`` (Muon with auxiliary AdamW, one optimizer, automatic optimization): the path to
Muon under pipeline parallelism. Under pp 2, tp 2 × pp 2, tp 2 × dp 2 with zero=1 and a mixture's tp 2 × ep 2 ×
expert_tp 2 (experts' 3-D weights orthogonalised expert by expert, their width split over expert_tp) it trains as one
process does, each matrix orthogonalised once per step."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.optim import DistributedOptimizer, Muon
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.models import BATCH, build, loader, reference_run, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

STEPS = 4


class OneMuonLM(HFCausalLM):
    """A user's module returning one optimizer: Muon over the matrices, AdamW over the rest."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__(family=family, labels=True)

    def configure_optimizers(self):
        return Muon(Muon.groups(self.model), lr=2e-3, adamw_lr=1e-3, adjust_lr_fn="match_rms_adamw")


def _reference(module: OneMuonLM, dp: int) -> dict:
    module = copy.deepcopy(module).double()
    optimizer = module.configure_optimizers()
    dataset = token_data(STEPS, dp)
    order = [list(DistributedSampler(dataset, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    for step in range(STEPS):
        idx = [i for r in range(dp) for i in order[r][step * BATCH:(step + 1) * BATCH]]
        optimizer.zero_grad()
        module.compute_loss(dataset.tensors[0][idx], dataset.tensors[1][idx]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, optimizer.newton_schulz_runs


def _fit(world_size: int, family: str, **strategy) -> dict:
    torch.manual_seed(0)
    module = OneMuonLM(family)
    dp = world_size // (strategy.get("tp", 1) * strategy.get("pp", 1))
    reference = _reference(module, dp)
    trainer = pl.Trainer(strategy=strategy_of(**strategy), accelerator="cpu", devices=world_size,
                         precision="64-true", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader(token_data(STEPS, dp)))
    optimizer = trainer.strategy.optimizers[0]
    optimizer = optimizer.inner if isinstance(optimizer, DistributedOptimizer) else optimizer  # zero=1: its ranges'
    return {"reference": reference, "state": trainer.strategy.full_state_dict(), "runs": optimizer.newton_schulz_runs,
            "placed": optimizer.mesh is trainer.strategy.mesh,
            "split over": sorted({name for name, spec in optimizer._splits.values() if spec is not None})}


def _gpt(world_size: int) -> dict:
    """The reference GPT's module with ``optimizer="muon"`` (``optim.name=muon`` in the recipes) at tp 2."""
    module = build("gpt", optimizer="muon")
    reference = reference_run(build("gpt", optimizer="muon"), token_data(STEPS, 1), STEPS, 1)
    trainer = pl.Trainer(strategy=SeqParallelStrategy(tp=world_size), accelerator="cpu", devices=world_size,
                         precision="64-true", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader(token_data(STEPS, 1)))
    names = {id(p): n for n, p in module.named_parameters()}
    muon = [names[id(p)] for g in trainer.strategy.optimizers[0].param_groups if g["use_muon"] for p in g["params"]]
    return {"reference": (reference.final_state, None), "state": trainer.strategy.full_state_dict(), "muon": muon,
            "placed": trainer.strategy.optimizers[0].mesh is trainer.strategy.mesh}


def _runs(rank, world_size):
    if world_size == 2:
        return {"pp2": _fit(2, "llama", pp=2), "gpt": _gpt(2)}
    return {"tp2_pp2": _fit(4, "llama", tp=2, pp=2), "moe": _fit(4, "qwen3_moe", tp=2, ep=2, expert_tp=2),
            "zero1": _fit(4, "llama", tp=2, zero=1)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_runs, 2), run_distributed(_runs, 4)


def test_one_optimizer_muon_trains_as_one_process_under_pipelines_and_experts(runs):
    two, four = runs
    cases = [("pp2", two), ("tp2_pp2", four), ("moe", four), ("zero1", four)]
    for case, ranks in cases:
        for run in ranks:
            run = run[case]
            assert run["placed"], case
            want, _ = run["reference"]
            for key, value in want.items():
                got = run["state"][f"model.{key}"]
                # as in test_muon: Muon's bfloat16 Newton-Schulz may round an element one way on one process and the
                # other way here (its gradient a bit away); AdamW's first steps amplify the reductions' last bits
                tolerance = 1e-3 if ".layers." in key and value.dim() >= 2 else 1e-6
                assert (got - value).norm() <= tolerance * value.norm(), (case, key)
    for run in two:  # the reference GPT's module, optim.name=muon: the layers' matrices (c_attn: fused q, k, v)
        run = run["gpt"]
        assert run["placed"]
        assert sorted(run["muon"]) == sorted(f"gpt.transformer.h.{i}.{m}.weight" for i in range(2)
                                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
        want, _ = run["reference"]
        for key, value in want.items():
            tolerance = 1e-3 if ".h." in key and value.dim() >= 2 else 1e-6
            assert (run["state"][key] - value).norm() <= tolerance * value.norm(), key
    assert all(r["pp2"]["split over"] == [] for r in two)
    assert all(r["tp2_pp2"]["split over"] == ["tp"] for r in four)
    assert all(r["moe"]["split over"] == ["etp", "tp"] for r in four)  # the experts' width over expert_tp
    # a dense model's replica (its pipeline stages and tensor-parallel ranks together) runs each matrix once a step
    for case, ranks in cases[:2] + cases[3:]:  # under zero=1 the data-parallel ranks share them out: once in all
        _, once = ranks[0][case]["reference"]
        assert sum(r[case]["runs"] for r in ranks) == once, case
