"""A decision made on one rank reaches every rank: its value, or its exception (one that cannot travel as itself
travels as its type and message)."""

import pytest

from lightning_seqpar.parallel.one_rank import decided_by_one_rank


class _Unpicklable(ValueError):
    def __init__(self, message, extra):  # pickling replays __init__ with args=(message,): unpickling fails
        super().__init__(message)
        self.extra = extra


def _relay(sent):
    return lambda obj: sent.append(obj) or obj  # the source's broadcast: what it sends is what it gets


def test_the_source_decides_and_sends_its_value_or_error():
    sent = []
    assert decided_by_one_rank(lambda: 3, True, _relay(sent)) == 3 and sent == [(3, None)]
    with pytest.raises(ValueError, match="refused"):
        decided_by_one_rank(lambda: (_ for _ in ()).throw(ValueError("refused")), True, _relay(sent))


def test_a_rank_that_does_not_decide_raises_what_it_receives():
    called = []
    with pytest.raises(ValueError, match="refused on rank 0"):
        decided_by_one_rank(lambda: called.append(1), False, lambda obj: (None, ValueError("refused on rank 0")))
    assert called == []  # it never ran the decision


def test_an_error_that_cannot_travel_is_sent_as_its_type_and_message():
    sent = []

    def decide():
        raise _Unpicklable("no layout fits", extra=1)

    with pytest.raises(RuntimeError, match="_Unpicklable: no layout fits"):
        decided_by_one_rank(decide, True, _relay(sent))
