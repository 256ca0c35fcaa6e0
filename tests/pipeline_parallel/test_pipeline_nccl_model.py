"""Every schedule's transfers, checked under NCCL's rules (FIFO per ordered pair, batches posted together,
rendezvous sends): no deadlock, and every receive gets the message it expects, with and without shape headers."""

import pytest

from lightning_seqpar.pipeline_parallel.comm_plan import (Batch, Transfer, build_program, carries_header, rank_program,
                                                          with_headers)
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.nccl_model import check_programs
from lightning_seqpar.pipeline_parallel.schedules import Action, build_schedule


def _configurations():
    for p in range(2, 9):
        for v in range(1, 5):
            for m in range(p, 17):
                for schedule in (("gpipe", "1F1B") if v == 1 else ("interleaved_1F1B",)):
                    if schedule == "interleaved_1F1B" and m % p:
                        continue  # the interleaved schedule needs m divisible by p (check_microbatches)
                    for forward_only in (False, True):
                        yield schedule, p, v, m, forward_only


CONFIGURATIONS = list(_configurations())
ZERO_BUBBLE = [(p, m, forward_only) for p in range(2, 9) for m in range(p, 33) for forward_only in (False, True)]


def test_every_schedule_is_deadlock_free_and_matched_under_nccl_rules():
    assert len(CONFIGURATIONS) == 492  # p 2..8, m p..16, v 1..4, training and forward-only
    for schedule, p, v, m, forward_only in CONFIGURATIONS:
        layout = StageLayout(p, v, (1,) * (p * v))
        programs = [build_program(schedule, m, layout, rank, forward_only) for rank in range(p)]
        check_programs(programs)
        check_programs([with_headers(program) for program in programs])  # a step whose shapes are new


def test_zb_h1_is_deadlock_free_and_matched_under_nccl_rules():
    """Its W's post nothing: the gradient a B produces is sent before the W that may follow (the batch after the B),
    so the previous stage is not kept waiting behind the weight gradient."""
    assert len(ZERO_BUBBLE) == 2 * sum(33 - p for p in range(2, 9))  # p 2..8, m p..32
    for p, m, forward_only in ZERO_BUBBLE:
        layout = StageLayout(p, 1, (1,) * p)
        programs = [build_program("ZB-H1", m, layout, rank, forward_only) for rank in range(p)]
        check_programs(programs)
        check_programs([with_headers(program) for program in programs])
        for rank, program in enumerate(programs[1:], start=1):  # the batch right after each B sends its gradient
            for before, after in zip(program, program[1:]):
                if isinstance(before, Action) and before.kind == "B":
                    assert isinstance(after, Batch) and any(
                        t.send and t.kind == "gradient" and t.microbatch == before.microbatch for t in after.transfers)


@pytest.mark.slow  # whole V schedules simulated step by step: outside the fast lane
@pytest.mark.parametrize("schedule", ["ZB-V", "DualPipeV"])
def test_v_schedules_are_deadlock_free_and_matched_under_nccl_rules(schedule):
    """The V placement: rounds of the unit-cost replay (comm_plan.timed_program), each message sent and received in
    the round its action ends; headers on the first boundaries only, the first message of each pair of ranks.
    (DualPipeV from m = 2p, its least.)"""
    for p, m, forward_only in ZERO_BUBBLE:
        if schedule == "DualPipeV" and m < 2 * p:
            continue
        layout = StageLayout(p, 2, (1,) * (2 * p), "V")
        programs = [build_program(schedule, m, layout, rank, forward_only) for rank in range(p)]
        check_programs(programs)
        check_programs([with_headers(program, layout) for program in programs])
        for rank, program in enumerate(programs):
            steps = [s for s in program if isinstance(s, Action)]
            assert steps == build_schedule(schedule, m, p, 2, rank, forward_only)
            transfers = [t for s in program if isinstance(s, Batch) for t in s.transfers]
            assert all(t.peer != rank for t in transfers)  # the turn (stage p − 1 to p) is handed over in memory
            headers = [t for t in transfers if carries_header(t, layout)]
            assert [(t.send, t.stage, t.microbatch) for t in headers] == \
                [(False, rank, 0)] * (rank > 0) + [(True, rank + 1, 0)] * (rank < p - 1)


def test_the_model_finds_the_deadlock_of_the_v_placement_s_transfers_posted_around_each_action():
    """1F1B's pattern (send after the action, receive before the next) on ZB-V's lists: neighbours each post a lone
    gradient send to the other (and a pair's messages arrive out of the order they are needed)."""
    layout = StageLayout(2, 2, (1,) * 4, "V")
    programs = [rank_program(build_schedule("ZB-V", 4, 2, 2, rank), layout, rank) for rank in range(2)]
    with pytest.raises(RuntimeError, match="deadlock under NCCL's rules|matched by order"):
        check_programs(programs)


def test_the_model_finds_the_deadlock_of_unpaired_interleaved_transfers():
    """The interleaved schedule with a batch around every action (1F1B's pattern) leaves a lone gradient send on
    rank 0 while rank 1 blocks in a send to rank 0: the model must see it."""
    layout = StageLayout(2, 2, (1,) * 4)
    programs = [rank_program(build_schedule("interleaved_1F1B", 4, 2, 2, rank), layout, rank) for rank in range(2)]
    with pytest.raises(RuntimeError, match="deadlock under NCCL's rules"):
        check_programs(programs)


def test_the_model_finds_two_neighbours_both_sending_first():
    send = lambda kind, stage, peer: Transfer(True, kind, stage, 0, peer)  # noqa: E731
    recv = lambda kind, stage, peer: Transfer(False, kind, stage, 0, peer)  # noqa: E731
    programs = [[Batch((send("activation", 1, 1),)), Batch((recv("gradient", 0, 1),))],
                [Batch((send("gradient", 0, 0),)), Batch((recv("activation", 1, 0),))]]
    with pytest.raises(RuntimeError, match="deadlock"):
        check_programs(programs)
    check_programs([[Batch((send("activation", 1, 1), recv("gradient", 0, 1)))],  # paired: fine
                    [Batch((send("gradient", 0, 0), recv("activation", 1, 0)))]])


def test_the_model_matches_by_order_not_by_name():
    first, second = Transfer(True, "activation", 1, 0, 1), Transfer(True, "activation", 1, 1, 1)
    programs = [[Batch((first,)), Batch((second,))],
                [Batch((Transfer(False, "activation", 1, 1, 0),)), Batch((Transfer(False, "activation", 1, 0, 0),))]]
    with pytest.raises(RuntimeError, match=r"expects \('activation', 1, 1\) from rank 0 but, matched by order, "
                                           r"receives \('activation', 1, 0\)"):
        check_programs(programs)
