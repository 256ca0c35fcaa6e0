"""The parity harness: the same training under SeqParallelStrategy in spawned processes, compared with one process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_seqpar import SelectiveRecompute
from tests.helpers.strategy import strategy_of
from tests.helpers.distributed import run_distributed
from tests.helpers.models import BATCH, Recorder, build, loader, reference_run, token_data

STEPS = 3


@dataclass(frozen=True)
class Case:
    kind: str  # "gpt" or "encoder"
    tp: int
    sequence_parallel: bool = True
    recompute: Optional[str] = None  # None, "selective", "full"
    model: tuple = field(default_factory=tuple)  # extra model kwargs as (key, value) pairs
    trainer: tuple = field(default_factory=tuple)  # extra Trainer kwargs as (key, value) pairs
    strategy: tuple = field(default_factory=tuple)
    pp: int = 1
    batch: int = BATCH  # samples per data-parallel rank and step (pp > 2 needs micro-batches >= pp)
    cp: int = 1
    # The reference runs each step's batch as this many accumulated micro-steps, as the pipeline's micro-batches: for a
    # loss that is not linear in the batch (a mixture's router losses, over each micro-batch's tokens).
    microbatches: int = 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


def fit(case: Case, world_size: int, steps: int = STEPS, callbacks=(), epoch_steps=None, ckpt_path=None,
        **overrides) -> Recorder:
    """Train ``case`` for ``steps`` optimizer steps (epochs of ``epoch_steps``); return what this rank recorded."""
    module = build(case.kind, **dict(case.model))
    recorder = Recorder()
    extra = list(callbacks)
    if case.recompute:
        extra.append(SelectiveRecompute(granularity=case.recompute))
    trainer_kwargs = dict(
        accelerator="cpu", devices=world_size, precision="64-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer_kwargs.update(dict(case.trainer))
    trainer_kwargs.update(overrides)
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    trainer = pl.Trainer(
        strategy=strategy_of(tp=case.tp, pp=case.pp, cp=case.cp, sequence_parallel=case.sequence_parallel,
                             **dict(case.strategy)),
        callbacks=[recorder, *extra], **trainer_kwargs,
    )
    data = token_data((epoch_steps or steps) * accumulate, case.dp(world_size), batch=case.batch)
    trainer.fit(module, loader(data, case.batch), ckpt_path=ckpt_path)
    return recorder


def _fit_all(rank: int, world_size: int, cases: list[Case]) -> dict[Case, Recorder]:
    # The records alone go back to the test (Lightning binds the module's log methods onto callbacks, and a model with
    # transformers' output-capturing hooks does not pickle).
    return {case: dataclasses.replace(fit(case, world_size)) for case in cases}


def run_cases(cases: dict[int, list[Case]], world_size: int) -> list[dict[Case, Recorder]]:
    """Every case of ``world_size``, trained in one group of spawned processes: each rank's records by case."""
    return run_distributed(_fit_all, world_size, cases[world_size])


def world_runs(cases: dict[int, list[Case]]) -> Callable:
    """A module-scoped fixture for a parity module: ``runs(world_size)`` trains that world's cases in one group of
    processes (:func:`run_cases`) the first time it is asked, and returns each rank's records by case."""
    @pytest.fixture(scope="module")
    def runs() -> Callable[[int], list[dict[Case, Recorder]]]:
        done: dict[int, list[dict[Case, Recorder]]] = {}

        def of(world_size: int) -> list[dict[Case, Recorder]]:
            if world_size not in done:
                done[world_size] = run_cases(cases, world_size)
            return done[world_size]
        return of
    return runs


def all_cases(cases: dict[int, list[Case]]) -> list[tuple[int, Case]]:
    return [(w, c) for w in cases for c in cases[w]]


def _stable(value: object) -> str:
    """``value`` as text that is the same in every process (no object addresses): a test id must be, for pytest's
    workers to agree on the collection."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_stable(v) for v in value) + ")"
    return type(value).__name__ if type(value).__repr__ is object.__repr__ else str(value)


def case_id(world_case: tuple[int, Case]) -> str:
    """A readable test id: model, layout, SP, recomputation, then what the case adds."""
    w, c = world_case
    model = "".join(f"-{k}={_stable(v)}" for k, v in c.model)
    strategy = "".join(f"-{k}={_stable(v)}" for k, v in c.strategy)
    return (f"{c.kind}-pp{c.pp}{f'cp{c.cp}' if c.cp > 1 else ''}tp{c.tp}dp{c.dp(w)}-{'sp' if c.sequence_parallel else 'nosp'}-{c.recompute}"
            f"{model}{strategy}{'-clip-accumulate' if c.trainer else ''}{f'-batch{c.batch}' if c.batch != BATCH else ''}")


def assert_matches_single_process(per_rank: list[dict[Case, Recorder]], case: Case, world_size: int,
                                  loss_rtol: float, loss_atol: float, grad_matches: Callable[[Tensor, Tensor], str]):
    """The single-process float64 reference of ``case`` against every rank's records.

    * the loss each rank logged (``sync_dist=True``: the global batch's) equals the reference, identically on
      every rank;
    * the loss ``training_step`` returned, averaged over data-parallel replicas, equals it on every pipeline
      stage (the mean over micro-batches; Lightning divides it by the accumulation count);
    * every parameter's gradient on every rank, before every optimizer step: ``grad_matches(got, want)`` returns
      what differs, or ``""``.
    """
    dp = case.dp(world_size)
    options = dict(case.trainer)
    accumulate = options.get("accumulate_grad_batches", 1)
    m = case.microbatches
    ref = reference_run(build(case.kind, **dict(case.model)), token_data(STEPS * accumulate, dp, batch=case.batch), STEPS,
                        dp, accumulate=accumulate * m, clip=options.get("gradient_clip_val"), batch=case.batch // m)
    want_losses = torch.tensor(ref.losses, dtype=torch.float64).view(-1, m).mean(1)
    for rank in range(world_size):
        record = per_rank[rank][case]
        logged = torch.tensor(record.logged, dtype=torch.float64)
        torch.testing.assert_close(logged, want_losses, rtol=loss_rtol, atol=loss_atol, msg=lambda m: f"rank {rank}: {m}")
        assert record.logged == per_rank[0][case].logged
        assert len(record.grads) == STEPS
        for step, (got, want) in enumerate(zip(record.grads, ref.grads)):
            assert got.keys() == want.keys(), set(got) ^ set(want)
            differences = {name: grad_matches(got[name], want[name]) for name in want}
            wrong = {n: d for n, d in differences.items() if d}
            assert wrong == {}, f"rank {rank} step {step}: {wrong}"
    for stage in range(case.pp):  # rank = tp_rank + t·(cp_rank + c·(dp_rank + d·pp_rank))
        replicas = [per_rank[(stage * dp + d) * case.cp * case.tp][case].losses for d in range(dp)]
        losses = torch.tensor(replicas, dtype=torch.float64).mean(0) * accumulate
        torch.testing.assert_close(losses, want_losses, rtol=loss_rtol, atol=loss_atol, msg=lambda m: f"stage {stage}: {m}")


def close(rtol: float, atol: float) -> Callable[[Tensor, Tensor], str]:
    """Element-wise comparison, as ``torch.testing.assert_close``."""
    def compare(got: Tensor, want: Tensor) -> str:
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as error:
            return str(error)
        return ""
    return compare


def relative_error_below(bound: float) -> Callable[[Tensor, Tensor], str]:
    """Whole-tensor comparison: ``‖got − want‖ / ‖want‖ < bound`` (a missing reduction by t = 2 gives ≥ 0.5)."""
    def compare(got: Tensor, want: Tensor) -> str:
        error = ((got - want).norm() / want.norm().clamp_min(1e-300)).item()
        return "" if error < bound else f"relative error {error:.3g}"
    return compare
