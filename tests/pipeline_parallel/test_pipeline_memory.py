"""1F1B bounds the activations a stage holds; GPipe holds every micro-batch's; ZB-H1 and ZB-V hold no more than 1F1B's
peak, DualPipeV one chunk micro-batch more than ZB-V (measured live bytes).

Stage 0 of a pp=2 GPT runs m=8 micro-batches; a storage tracker records, after every action of the
schedule, the bytes still alive that the stage's transformer layers created in forward.
"""

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.memory.tracker import LiveActivationTracker
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SEQ, build, token_data
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

M, P = 8, 2
LAYERS = "gpt.transformer.h"


class _Measure(pl.Callback):
    """Live bytes of the layer stack's forward storages after each schedule action (first batch)."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracker = LiveActivationTracker(pl_module).__enter__()
        executor = trainer.strategy.pipeline.executor
        executor.observers.append(lambda action, in_flight: self.samples.append(
            (repr(action), in_flight, self.tracker.live_bytes(LAYERS), self.tracker.live_bytes())))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tracker.__exit__(None, None, None)
        trainer.strategy.pipeline.executor.observers.clear()


def _measure(rank, world_size, model=(), schedules=("1F1B", "gpipe", "ZB-H1")):
    out = {}
    for schedule in schedules:
        measure = _Measure()
        trainer = pl.Trainer(
            strategy=strategy_of(pp=P, num_microbatches=M, schedule=schedule), accelerator="cpu",
            devices=world_size, precision="64-true", max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[measure],
        )
        trainer.fit(build("gpt", **dict(model)), DataLoader(token_data(M // 2, 1), batch_size=M))
        out[schedule] = measure.samples
    return out


@pytest.fixture(scope="module")
def samples():
    return run_distributed(_measure, P)


def _kept_for_w(samples, rank: int) -> int:
    """Bytes one micro-batch keeps between its B and its W on ``rank`` under ZB-H1, checked at every action: the
    live bytes are whole micro-batches (F done, B not) plus that much per micro-batch waiting for its W."""
    zb, cached = samples[rank]["ZB-H1"], samples[rank]["1F1B"][-1][2]
    whole = zb[0][2] - cached
    counts = {"F": 0, "B": 0, "W": 0}
    kept = None
    for action, _, live, _ in zb:
        counts[action[0]] += 1
        waiting = counts["B"] - counts["W"]
        if waiting and kept is None:
            kept = (live - cached - whole * (counts["F"] - counts["B"])) // waiting
        assert live == cached + whole * (counts["F"] - counts["B"]) + (kept or 0) * waiting, (rank, action)
    assert kept is not None and kept < whole / 2, (kept, whole)
    return kept


@pytest.mark.parametrize("schedule, bound", [("1F1B", P), ("gpipe", M)])
def test_first_stage_holds_activations_of_at_most_the_schedules_in_flight_micro_batches(samples, schedule, bound):
    stage0 = samples[0][schedule]
    assert len(stage0) == 2 * M  # every micro-batch forward and backward once
    cached = stage0[-1][2]  # alive after the last backward: the causal mask, built once per layer
    one = stage0[0][2] - cached  # after the first forward: one micro-batch's activations
    assert stage0[0][1] == 1 and one > 100 * cached
    for action, in_flight, live, _ in stage0:
        assert live == cached + in_flight * one, (action, in_flight, live, one)
    assert max(n for _, n, _, _ in stage0) == bound
    assert max(live for _, _, live, _ in stage0) == cached + bound * one


def test_last_stage_of_1f1b_holds_one_micro_batch(samples):
    last = samples[1]["1F1B"]
    assert max(n for _, n, _, _ in last) == 1


def test_the_last_stage_keeps_no_micro_batch_s_input_after_its_backward(samples):
    # The step's result keeps each micro-batch's loss (float64 scalars), not its graph: through the graph's nodes
    # the received stage input and its gradient ([s, b, h] each) would stay alive until the step ends.
    after_backward = [total for action, _, _, total in samples[1]["1F1B"] if action.startswith("B")]
    assert len(after_backward) == M
    growth = [later - earlier for earlier, later in zip(after_backward, after_backward[1:])]
    assert all(0 <= g <= 16 for g in growth), growth  # two float64 scalars: the loss kept for the result, and one more


def test_zb_h1_holds_at_most_1f1b_s_peak_on_every_stage(samples):
    """ZB-H1 delays stage r's W's by r micro-batches: every stage holds p micro-batches from F to W, the last one
    waiting for its W only (what B freed is gone), so no stage's peak passes 1F1B's first stage's, which it equals."""
    peak_1f1b = max(live for _, _, live, _ in samples[0]["1F1B"])
    for rank in range(P):
        zb = samples[rank]["ZB-H1"]
        assert len(zb) == 3 * M and max(n for _, n, _, _ in zb) == P  # F, B and W of each micro-batch
        assert max(live for _, _, live, _ in zb) <= peak_1f1b
    assert max(live for _, _, live, _ in samples[0]["ZB-H1"]) == peak_1f1b
    # every sample is whole micro-batches (F done, B not) and micro-batches waiting for their W only, which keep of
    # what the forward made what W reads: the split linears' inputs (their output gradients are B's, not counted here)
    for rank in range(P):
        # the inputs of the four split linears per layer: two norm outputs [s, b, h], the context [s, b, h] and the
        # activation [s, b, 4h] (float64, one layer per stage, micro-batches of one sequence)
        assert _kept_for_w(samples, rank) == 8 * SEQ * (2 * 16 + 16 + 64)


def test_zb_h1_keeps_a_mixture_s_expert_rows_for_w_as_the_planner_prices_them():
    # At ep 1 every (token, expert) pair is computed here: s·k rows of h into the experts and of f_e between their
    # projections (k = 2, f_e = 4h/k = 32), beside the attention's split inputs (norm output, context). The router's
    # weight gradient stays in B: its input is not kept for W.
    from lightning_seqpar.plan.pricing.activations import weight_gradient_bytes
    from lightning_seqpar.plan.pricing.model_inventory import ExpertShape, ParameterEntry
    from lightning_seqpar.plan.measuring.models import gpt2_config, model_inventory

    moe = run_distributed(_measure, P, (("n_experts", 8),), ("1F1B", "ZB-H1"))
    for rank in range(P):
        assert _kept_for_w(moe, rank) == 8 * SEQ * (16 + 16 + 2 * (16 + 32))
    inventory = model_inventory(gpt2_config(vocab_size=13, n_positions=SEQ, n_embd=16, n_head=4, n_layer=2))
    # the dense GPT's inventory made the mixture's: its MLP the trained experts', no dense MLP projection left
    inventory.experts = ExpertShape(8, 2, 32)
    inventory.split_projections = tuple(p for p in inventory.split_projections if p.group == "attention")
    inventory.entries.append(ParameterEntry("experts.gate_up_proj", (8, 16, 64), "expert", "layer", 0, deferred=True))
    # what was measured, plus the output gradients B makes for W: q/k/v's 3h, o_proj's h, and per expert row the
    # gate/up projection's 2f_e and the down projection's h
    assert weight_gradient_bytes(inventory, SEQ, 1, 1, element=8) == 8 * SEQ * (16 + 16 + 2 * (16 + 32) +
                                                                                 3 * 16 + 16 + 2 * (2 * 32 + 16))


def test_zb_v_holds_at_most_1f1b_s_peak_on_every_stage():
    """ZB-V (4 layers at pp 2: chunks of one layer in a V) holds at most 2p chunk micro-batches from F to W on every
    rank, of L/2p layers each: its layers' live bytes never pass 1F1B's first stage's (p micro-batches of L/p layers),
    though rank 0 runs the first and the last stage. DualPipeV on the same V holds one chunk micro-batch more."""
    measured = run_distributed(_measure, P, (("n_layer", 4),), ("1F1B", "ZB-V", "DualPipeV"))
    peak_1f1b = max(live for _, _, live, _ in measured[0]["1F1B"])
    for rank in range(P):
        v = measured[rank]["ZB-V"]
        assert len(v) == 2 * 3 * M and max(n for _, n, _, _ in v) == 2 * P  # F, B and W of each chunk's micro-batch
        assert max(live for _, _, live, _ in v) <= peak_1f1b
        # DualPipeV: one chunk micro-batch more (DeepSeek's PP + 1), so one chunk's worth above ZB-V at most
        dual = measured[rank]["DualPipeV"]
        assert len(dual) == 2 * 3 * M and max(n for _, n, _, _ in dual) == 2 * P + 1
        chunk = max(live for _, _, live, _ in v) / (2 * P)
        assert max(live for _, _, live, _ in v) < max(live for _, _, live, _ in dual) <= \
            max(live for _, _, live, _ in v) + chunk
