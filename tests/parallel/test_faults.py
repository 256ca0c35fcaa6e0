"""A failed collective is named with its call site, and a timeout told apart from a lost peer."""

import torch.distributed as dist

from lightning_seqpar.parallel.faults import failed_collective


def _raise_inside_a_collective(message):
    # A stand-in for gloo raising from work.wait() inside torch.distributed.all_reduce.
    def all_reduce():
        raise RuntimeError(message)

    all_reduce.__code__ = all_reduce.__code__.replace(co_filename=dist.distributed_c10d.__file__)
    try:
        all_reduce()
    except RuntimeError as error:
        return error


def test_gloo_timeouts_in_both_wordings_and_a_lost_peer():
    for message in ("Timed out waiting 8000ms for recv operation to complete", "Application timeout caused pair closure"):
        failure = failed_collective(_raise_inside_a_collective(message))
        assert failure.timed_out and failure.collective.startswith("torch.distributed.all_reduce (called at ")
        assert "test_faults.py" in failure.collective
    lost = failed_collective(_raise_inside_a_collective("Connection closed by peer [127.0.0.1]:1234"))
    assert lost is not None and not lost.timed_out


def test_the_process_group_of_a_failed_collective_is_named():
    class Group:
        group_desc = "async_save"

    def all_reduce(tensor, group=None):
        raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")

    all_reduce.__code__ = all_reduce.__code__.replace(co_filename=dist.distributed_c10d.__file__)
    for group, name in ((Group(), "async_save"), (None, "default_pg")):
        try:
            all_reduce(None, group=group)
        except RuntimeError as error:
            assert failed_collective(error).collective.endswith(f" on process group '{name}'")


def test_an_error_outside_collectives_is_not_a_collective_failure():
    assert failed_collective(ValueError("timed out reading a file")) is None


def test_an_asynchronous_collective_is_named_where_it_is_waited_for():
    from lightning_seqpar.parallel.collectives import Pending

    class FailingWork:
        def wait(self):
            raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")

    try:
        Pending(None, FailingWork(), kind="reduce_scatter", group="mesh_tensor").wait()
    except RuntimeError as error:
        failure = failed_collective(error)
    assert failure is not None and failure.timed_out
    assert failure.collective.startswith("torch.distributed.reduce_scatter (called at ")
    assert failure.collective.endswith(" on process group 'mesh_tensor'")
