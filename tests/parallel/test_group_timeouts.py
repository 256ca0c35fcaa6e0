"""Every process group the library creates waits for a peer as long as the strategy's timeout says, not torch's
default 30 minutes: the mesh's groups (tensor, data, pipeline, the first and last stage, the gloo twins) and the group
of background checkpoint saves. A rank that skips a collective on one of them ends its peer's wait after the
timeout."""

import time
from datetime import timedelta

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

TIMEOUT = timedelta(seconds=3)


def _timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _strategy_groups(rank, world_size, directory):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_seqpar import SeqParallelStrategy
    from tests.helpers.models import build, loader, token_data

    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, strategy=strategy_of(tp=2, timeout=7, async_save=True),
                         callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=1)])
    trainer.fit(build("gpt"), loader(token_data(1, 1)))
    mesh = trainer.strategy.mesh
    groups = {"tensor": mesh.tensor.group, "data": mesh.data.group, "pipeline": mesh.pipeline.group,
              "async save": trainer.strategy.checkpointer.writer.process_group}
    return {name: _timeout(group) for name, group in groups.items()}


def test_the_strategys_groups_and_its_async_save_group_take_its_timeout(tmp_path):
    for timeouts in run_distributed(_strategy_groups, 2, str(tmp_path)):
        assert timeouts == {"tensor": 7.0, "data": 7.0, "pipeline": 7.0, "async save": 7.0}


def _skipped_collective(rank, world_size):
    import torch.distributed as dist

    from lightning_seqpar.parallel.mesh import ParallelMesh

    mesh = ParallelMesh.build(1, 4, "cpu", host_groups=True, timeout=TIMEOUT)  # pp 4: first-and-last groups too
    groups = {"tensor": mesh.tensor, "pipeline": mesh.pipeline, "embedding": mesh.embedding,
              **{f"host {k}": v for k, v in mesh.host_groups.items()}}
    timeouts = {name: _timeout(g.group) for name, g in groups.items() if g.group is not None}
    waited = None
    if rank == 0:  # rank 3 never joins this all-reduce: rank 0 gives up after the timeout
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=mesh.embedding.group)
        except RuntimeError:
            waited = time.monotonic() - start
    else:  # reach the closing barrier soon after rank 0 (the pipeline group spans the world: it is the default group)
        time.sleep(TIMEOUT.total_seconds() + 1)
    return timeouts, waited


def test_a_peer_that_skips_a_collective_on_a_subgroup_is_given_up_after_the_timeout():
    ranks = run_distributed(_skipped_collective, 4)
    for timeouts, _ in ranks:
        assert set(timeouts.values()) == {TIMEOUT.total_seconds()}, timeouts
        assert {"tensor", "pipeline", "host dp_cp", "host pp", "host tp"} <= set(timeouts)
    waited = ranks[0][1]
    # given up after this group's timeout, not torch's default 30 minutes (the margin: a loaded machine's)
    assert waited is not None and TIMEOUT.total_seconds() - 0.5 <= waited <= TIMEOUT.total_seconds() + 15, waited
