"""Optimizers that read whole matrices, under the strategy: ``torch.optim.Muon`` beside AdamW (torch's recommended
split, manual optimization as users write it) trains under tp 2, tp 2 × dp 2 (zero 0 and 1) and a mixture's
tp 2 × ep 2 exactly as one process does; each matrix is orthogonalised once per step, and the pieces moved are the
formula's bytes. Optimizers that are not element-wise are refused on split parameters and kept where every rank holds
whole ones."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_gradients
from lightning_seqpar.optim.matrix_owners import Matrix, exchange_bytes
from lightning_seqpar.optim import DistributedOptimizer, Muon
from lightning_seqpar.optim.sharded_muon import ShardedMuon, matrix_split
from lightning_seqpar.parallel import CommunicationLog
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.models import BATCH, loader, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

STEPS = 5


class MuonLM(HFCausalLM):
    """A user's module: Muon over the layers' matrices, AdamW over the rest (embeddings, head, norms, experts' 3-D
    stacks), stepped by hand."""

    def __init__(self, family: str = "llama", optimizer: str = "muon", kv_heads: int = 2) -> None:
        super().__init__(family=family, labels=True, kv_heads=kv_heads)
        self.automatic_optimization = False
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        hidden = [p for n, p in self.model.named_parameters() if ".layers." in n and p.ndim == 2]
        chosen = {id(p) for p in hidden}
        rest = [p for p in self.model.parameters() if id(p) not in chosen]
        return [torch.optim.Muon(hidden, lr=2e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3)]

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        loss = self.compute_loss(*batch)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        self.log("train/loss", loss, sync_dist=True)
        return loss


def _reference(module: MuonLM, dp: int, steps: int = STEPS) -> tuple[list[float], dict]:
    """One process, float64, the global batch of each step."""
    module = copy.deepcopy(module).double()
    optimizers = module.configure_optimizers()
    dataset = token_data(steps, dp)
    order = [list(DistributedSampler(dataset, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    losses = []
    for step in range(steps):
        idx = [i for r in range(dp) for i in order[r][step * BATCH:(step + 1) * BATCH]]
        loss = module.compute_loss(dataset.tensors[0][idx], dataset.tensors[1][idx])
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.model.state_dict().items()}


class _Watch(pl.Callback):
    """Per step: the loss; the Muon's exchanges logged on its groups; and one process's ``torch.optim.Muon`` over the
    gathered matrices, fed the gathered gradients, against the gathered result of the sharded step."""

    def __init__(self):
        self.losses, self.logs, self.shadow, self.apart = [], {}, None, []

    def on_train_start(self, trainer, pl_module):
        for name in ("tp", "etp"):
            self.logs[name] = trainer.strategy.mesh.group(name).log = CommunicationLog()
        muon = trainer.strategy.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.names = [names[id(p)] for p in muon.param_groups[0]["params"]]
        full = trainer.strategy.full_state_dict()
        self.params = [torch.nn.Parameter(full[n].clone()) for n in self.names]
        self.shadow = torch.optim.Muon(self.params, **muon.defaults)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        optimizer = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if optimizer is not trainer.strategy.optimizers[0]:
            return
        distributed = isinstance(optimizer, DistributedOptimizer)
        mine = optimizer.param_groups[0]["params"]
        if distributed:  # zero=1: each data-parallel rank holds a range of the gradient; assembled for the shadow
            for p in mine:
                p.grad = optimizer.gathered_gradient(p)
        grads = full_gradients(pl_module, trainer.strategy.mesh)
        if distributed:
            for p in mine:
                p.grad = None
        for name, p in zip(self.names, self.params):
            p.grad = grads[name].clone()
        self.shadow.step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        full = trainer.strategy.full_state_dict()
        self.apart.append(max(float((full[n] - p.detach()).abs().max()) for n, p in zip(self.names, self.params)))
        for name, p in zip(self.names, self.params):  # the next step from the sharded run's own parameters
            p.data.copy_(full[name])
        self.losses.append(trainer.callback_metrics["train/loss"].item())


def _fit(world_size: int, family: str, **strategy) -> dict:
    torch.manual_seed(0)
    module = MuonLM(family)
    dp = world_size // strategy.get("tp", 1)
    reference = _reference(module, dp)
    watch = _Watch()
    trainer = pl.Trainer(strategy=strategy_of(**strategy), accelerator="cpu", devices=world_size,
                         precision="64-true", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[watch])
    trainer.fit(module, loader(token_data(STEPS, dp)))
    muon = trainer.strategy.optimizers[0]
    zero = isinstance(muon, DistributedOptimizer)
    mesh = trainer.strategy.mesh
    matrices: dict[str, list] = {}
    for p in muon.param_groups[0]["params"]:
        name, spec = matrix_split(p, mesh)
        matrices.setdefault(name, []).append(Matrix(p.detach(), spec))
    expected = {name: STEPS * exchange_bytes(found, mesh.group(name).size if name else 1, 2)
                for name, found in matrices.items() if name}
    return {"losses": watch.losses, "apart": watch.apart, "reference": reference,
            "state": trainer.strategy.full_state_dict(),
            "sharded": isinstance(muon.inner if zero else muon, (ShardedMuon, Muon)), "zero": int(zero),
            "runs": (muon.inner if zero else muon).newton_schulz_runs,
            "matrices": len(muon.param_groups[0]["params"]), "tp": mesh.group("tp").size,
            "moved": {name: log.bytes_moved("all_to_all_v") for name, log in watch.logs.items()},
            "exchanges": {name: log.count("all_to_all_v") for name, log in watch.logs.items()},
            "expected": expected, "groups": {n: len(found) for n, found in matrices.items()}}


def _adafactor(world_size: int, tp: int) -> str:
    """Adafactor (a factored second moment: not element-wise) over the whole model: what fitting it says."""
    trainer = pl.Trainer(strategy=SeqParallelStrategy(tp=tp), accelerator="cpu", devices=world_size,
                         precision="64-true", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(MuonLM("llama", "adafactor"), loader(token_data(1, world_size // tp)))
    except ValueError as error:
        return str(error)
    return f"trained {trainer.global_step} step(s)"


def _runs(rank, world_size):
    if world_size == 2:
        return {"tp2": _fit(2, "llama", tp=2), "adafactor tp2": _adafactor(2, 2), "adafactor dp2": _adafactor(2, 1)}
    return {"tp2_dp2": _fit(4, "llama", tp=2), "tp2_ep2": _fit(4, "qwen3_moe", tp=2, ep=2),
            "tp2_dp2_zero1": _fit(4, "llama", tp=2, zero=1)}


@pytest.fixture(scope="module")
def runs():
    two, four = run_distributed(_runs, 2), run_distributed(_runs, 4)
    return [dict(a) for a in two], [dict(a) for a in four]


def _cases(runs):
    two, four = runs
    for rank, ranks in enumerate(two):
        yield "tp2", rank, ranks["tp2"]
    for rank, ranks in enumerate(four):
        yield "tp2_dp2", rank, ranks["tp2_dp2"]
        yield "tp2_ep2", rank, ranks["tp2_ep2"]
        yield "tp2_dp2_zero1", rank, ranks["tp2_dp2_zero1"]


def test_muon_with_adamw_trains_as_one_process(runs):
    for case, rank, run in _cases(runs):
        losses, state = run["reference"]
        assert run["sharded"], case
        # (the logged loss is a float32 metric)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-6, atol=0, msg=case)
        for key, want in state.items():
            got = run["state"][f"model.{key}"]
            # relative per parameter. AdamW's first steps divide near-zero gradients by their own root mean square,
            # which turns the last bits of the reductions' order into 1e-7 of the embedding after 5 steps; Muon's
            # Newton-Schulz runs in bfloat16 (torch's), where a gradient one bit away may round an element of the
            # matrix to the next bfloat16 value (2^-8 of it): 3e-4 of a matrix after 5 steps with dp 2, bit for bit
            # at tp 2. Each step alone is bit for bit torch's (the next test).
            tolerance = 1e-3 if ".layers." in key and want.dim() == 2 else 1e-6
            assert (got - want).norm() <= tolerance * want.norm(), (case, key)


def test_each_step_equals_torch_muon_on_the_gathered_matrices_bit_for_bit(runs):
    # the same gradients in, the same update out: the sharded step is torch's, on the single-device matrix
    for case, _, run in _cases(runs):
        assert run["apart"] == [0.0] * STEPS, case


def _replicas(run) -> int:
    """How many times each matrix is orthogonalised per step: once per model replica (its tensor-parallel ranks
    together), or once in all under zero=1, where the data-parallel ranks share the matrices out too."""
    return 1 if run["zero"] else len(run["everyone"]) // run["tp"]


def test_each_matrix_is_orthogonalised_once_per_step(runs):
    for case, rank, run in _cases(runs):
        if rank:
            continue
        every = [r for c, _, r in _cases(runs) if c == case]
        run = dict(run, everyone=every)
        assert sum(r["runs"] for r in every) == _replicas(run) * STEPS * run["matrices"], case
        assert all(r["runs"] < STEPS * run["matrices"] for r in every), case  # spread over the ranks


def test_the_pieces_moved_are_the_formula(runs):
    for case, rank, run in _cases(runs):
        assert run["expected"], case
        for name, expected in run["expected"].items():
            # two all_to_all_v per step and group (under zero=1 the data-parallel group's two more are its own)
            assert run["exchanges"][name] == 2 * STEPS, (case, name)
        if rank:
            continue
        every = [r for c, _, r in _cases(runs) if c == case]
        run = dict(run, everyone=every)
        for name in run["expected"]:  # the bytes leaving every rank of every group, in all, are the formula's
            assert sum(r["moved"][name] for r in every) == _replicas(run) * run["expected"][name], (case, name)


def test_an_optimizer_that_is_not_element_wise_is_refused_on_shards_and_kept_on_whole_parameters(runs):
    two, _ = runs
    for ranks in two:
        refused = ranks["adafactor tp2"]
        assert refused.startswith("Adafactor is not an element-wise optimizer"), refused
        assert "model.model.layers.0.self_attn.q_proj.weight (over tp: 2)" in refused, refused
        assert "torch.optim.Muon and lightning_seqpar.optim.Muon are made exact" in refused, refused
        assert "elementwise = True" in refused, refused
        assert ranks["adafactor dp2"] == "trained 1 step(s)"  # data-parallel replicas hold whole parameters
