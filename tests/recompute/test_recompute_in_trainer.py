"""``granularity="auto"`` inside a Trainer plans from the first batch and trains like one process."""

import pytest
import torch

from lightning_seqpar import SelectiveRecompute
from lightning_seqpar.memory import TransformerShape, layer_activation_bytes

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _fit_with_auto(rank, world_size):
    from tests.helpers.models import BATCH, SEQ
    from tests.helpers.parity import Case, fit

    shape = TransformerShape(s=SEQ, b=BATCH, h=16, a=4, L=2)
    per = {r: layer_activation_bytes(shape, 2, True, r, bytes_per_element=8) for r in ("selective", "full")}
    callback = SelectiveRecompute(granularity="auto", memory_budget=per["full"] + per["selective"])
    rec = fit(Case("gpt", 2, True, None), world_size, callbacks=[callback])
    return callback.plan, rec.losses, rec.grads


def test_auto_inside_a_trainer_plans_from_the_first_batch_and_trains_identically():
    from tests.helpers.distributed import run_distributed
    from tests.helpers.models import build, reference_run, token_data
    from tests.helpers.parity import STEPS

    plan, losses, grads = run_distributed(_fit_with_auto, 2)[0]
    assert (plan.granularity, plan.full_layers) == ("selective", 1)  # layer 0 whole, layer 1 core attention
    ref = reference_run(build("gpt"), token_data(STEPS, 1), STEPS, 1)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref.losses, dtype=torch.float64),
                               rtol=1e-9, atol=1e-11)
    for got, want in zip(grads, ref.grads):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11)
