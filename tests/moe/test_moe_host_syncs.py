"""The host reads of a mixture-of-experts training step are the documented ones only: one ``.tolist()`` of the split
sizes per MoE layer call (each layer's forward; again in a recomputed forward; under expert tensor parallelism too),
none with an expert capacity, nothing else (counted by ``HostSyncCounter``, every step after the first)."""

import pytest

from lightning_seqpar import DispatchConfig, HostSyncCounter
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed

LAYERS = 2  # every layer of the tiny Qwen3-MoE is a mixture
CASES = [  # (case, host reads per step)
    (Case("hf", 2, True, None, (("family", "qwen3_moe"), ("labels", True)), (), (("ep", 2),)), LAYERS),
    (Case("hf", 2, True, "full", (("family", "qwen3_moe"), ("labels", True)), (), (("ep", 2),)), 2 * LAYERS),
    (Case("hf", 2, True, None, (("family", "qwen3_moe"), ("labels", True)), (),
          (("ep", 2), ("moe", DispatchConfig(1.0)))), 0),  # with a capacity: fixed sizes, nothing read
    (Case("hf", 2, True, None, (("family", "qwen3_moe"), ("labels", True)), (), (("expert_tp", 2),)),
     LAYERS),  # each expert's width over 2 ranks: the width slices go in the same one all-to-all
]


def _counts(rank, world_size):
    out = []
    for case, _ in CASES:
        syncs = HostSyncCounter()
        fit(case, world_size, callbacks=[syncs])
        out.append(syncs.per_step)
    return out


def test_one_host_read_per_mixture_of_experts_layer_call_and_no_other():
    for rank, per_case in enumerate(run_distributed(_counts, 2)):
        for (case, reads), per_step in zip(CASES, per_case):
            assert per_step[1:] == [reads, reads], (rank, case, per_step)
