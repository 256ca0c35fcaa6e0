"""The live-storage tracker counts what a forward leaves alive, once."""

import torch

from lightning_seqpar.memory.tracker import LiveActivationTracker


def test_tracker_counts_live_outputs_once_and_ignores_views_and_inputs():
    x = torch.randn(64, 32, requires_grad=True)
    with LiveActivationTracker() as tracker:
        a = x.sin()  # kept: cos saves its input
        b = a.t()  # a view: no new storage
        c = b.cos()  # the output, held here
        c.add_(1)  # in place: same storage
        tmp = c * 2  # noqa: F841  # alive while this frame holds it
        del tmp
    assert sorted(r.op for r in tracker.live()) == ["cos.default", "sin.default"]
    assert tracker.live_bytes() == 2 * 64 * 32 * 4
