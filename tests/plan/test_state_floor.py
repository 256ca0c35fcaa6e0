"""A layout whose model state alone exceeds the GPU is rejected before its activations are priced
(``plan(state_floor=True)``, what the command line's hints ask): the floor never exceeds the priced peak, the
feasible layouts and their figures are those of the full search, and no probe is measured for what the floor
rejected. A rank's state is derived once per inventory, and a changed inventory derives its own."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_seqpar.plan import Hardware, model_inventory, plan, state_bytes
from tests.plan.test_planner import LLAMA3_8B

pytestmark = pytest.mark.slow  # a whole search, and the planner's probes: the full suite runs it


def _key(record):
    return record.layout.replace(num_microbatches=None), record.dp, record.micro_batch


def test_the_floor_rejects_only_layouts_the_full_search_finds_too_large_and_never_exceeds_their_peak():
    inventory = model_inventory(LLAMA3_8B)
    hardware = Hardware.named("h100", memory=80e9)
    options = dict(hardware=hardware, calibrate=False, schedule=("1F1B", "ZB-V"))
    whole = {_key(r): r for r in plan(inventory, 8, 4096, 16, **options)}
    floored = plan(inventory, 8, 4096, 16, state_floor=True, **options)
    rejected = [r for r in floored if r.state_floor]
    assert rejected and any(r.feasible for r in floored)  # (the case decides both ways)
    for record in rejected:
        assert not record.bytes and record.state_floor > 0.8 * hardware.memory
        assert "its model state alone needs" in record.reason
        assert whole[_key(record)].bytes["total"] >= record.state_floor  # a floor: the priced peak is above it
    for record in floored:
        if not record.state_floor:
            assert record.feasible == whole[_key(record)].feasible
            assert record.bytes == whole[_key(record)].bytes and record.step_time == whole[_key(record)].step_time
    assert [_key(r) for r in floored if r.feasible] == [_key(r) for r in whole.values() if r.feasible]


class _Probed(Exception):
    pass


class _StopAtProbe(dict):
    """The probes' cache, stopping the plan at the first probe measured into it."""

    def __setitem__(self, key, value):
        if key[0] == "probe":
            raise _Probed
        super().__setitem__(key, value)


def test_layouts_below_the_floor_are_not_probed():
    config = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=512)
    inventory = model_inventory(config)
    # room for no layout's model state (a few MB): the full search probes, the floor probes nothing
    hardware = Hardware.named("h100", memory=1e6)
    with pytest.raises(_Probed):  # (stopped at its first probe)
        plan(inventory, 2, 64, 2, hardware=hardware, fits=_StopAtProbe(), micro_batches=(1,))
    floored = _StopAtProbe()
    records = plan(inventory, 2, 64, 2, hardware=hardware, fits=floored, state_floor=True, micro_batches=(1,))
    assert not floored
    assert all(r.state_floor or r.reason and "needs" not in r.reason for r in records)


def test_a_rank_s_state_is_derived_once_and_a_changed_inventory_derives_its_own():
    inventory = model_inventory(LLAMA3_8B)
    first = state_bytes(inventory, 2, 2, 2, zero=1)
    assert state_bytes(inventory, 2, 2, 2, zero=1) is first  # the same value, derived once
    frozen = dataclasses.replace(inventory, entries=[dataclasses.replace(e, trainable=e.part != "embedding")
                                                     for e in inventory.entries])
    assert state_bytes(frozen, 2, 2, 2, zero=1).optimizer < first.optimizer  # not the first inventory's
