"""The rewrite's self-check runs on one rank of the job, and its verdict is raised on every rank, before training."""

import lightning.pytorch as pl
import pytest

from lightning_seqpar import SeqParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, loader, token_data

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _fit(rank, world_size, family):
    import lightning_seqpar.hf.vocabulary as vocabulary

    calls = []
    check = vocabulary.check_causal_lm

    def counted(*args, **kwargs):
        calls.append(rank)
        return check(*args, **kwargs)

    vocabulary.check_causal_lm = counted
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=2), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    try:
        trainer.fit(build("hf", family=family, labels=True), loader(token_data(1, 1)))
    except ValueError as error:
        return len(calls), type(error).__name__, str(error)
    return len(calls), None, trainer.global_step


@pytest.mark.parametrize("family", ["olmo", "llama"])
def test_one_rank_checks_and_every_rank_raises_its_verdict(family):
    """OLMo clips q/k/v inside its attention's forward: the whole-model check refuses it naming the setting, on both
    ranks, though only rank 0 ran it; Llama passes and both ranks train."""
    (calls0, kind0, out0), (calls1, kind1, out1) = run_distributed(_fit, 2, family)
    assert (calls0, calls1) == (1, 0)
    assert (kind0, out0) == (kind1, out1)
    if family == "olmo":
        assert kind0 == "ModelCheckError" and "config.clip_qkv=0.5" in out0
    else:
        assert kind0 is None and out0 == 1
