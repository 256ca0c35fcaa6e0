"""``HostSyncCounter`` and ``counting_host_reads`` count exactly the reads a step makes, and leave nothing patched."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_seqpar import HostSyncCounter
from lightning_seqpar.lightning.callbacks import counting_host_reads


class _Reads(pl.LightningModule):
    """One ``.item()`` in the forward, one ``.tolist()`` of 3 values, and one more ``.item()`` in backward's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = self.layer(x)
        out.max().item()
        x[0, :3].tolist()
        out.register_hook(lambda grad: grad.abs().sum().item() and None)
        return out.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_each_step_s_reads_are_counted_and_the_strategy_is_restored():
    counter = HostSyncCounter()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[counter])
    trainer.fit(_Reads(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
    assert counter.per_step == [3, 3]  # two scalar reads (forward, backward) and one list
    assert [(r.scalars, r.lists) for r in counter.reads] == [(2, [3]), (2, [3])]
    assert "training_step" not in vars(trainer.strategy) and "backward" not in vars(trainer.strategy)


def test_the_block_counts_scalars_and_lists_and_unpatches_on_error():
    tolist = torch.Tensor.tolist
    with pytest.raises(RuntimeError, match="inside"):
        with counting_host_reads() as reads:
            t = torch.arange(5.0)
            float(t.sum()), t.tolist(), bool(t[1] > 0)
            raise RuntimeError("inside")
    assert (reads.scalars, reads.lists, reads.total) == (2, [5], 3)
    assert torch.Tensor.tolist is tolist
    with counting_host_reads(into=reads) as again:  # a later block adds to the same record
        torch.ones(2).tolist()
    assert again is reads and (reads.scalars, reads.lists) == (2, [5, 2])


def test_an_unknown_debug_mode_is_refused():
    with pytest.raises(ValueError, match="cuda_sync_debug='raise': 'warn', 'error' or None"):
        HostSyncCounter(cuda_sync_debug="raise")


def test_a_barrier_counts_as_a_host_sync_and_the_strategy_s_reduce_makes_none(tmp_path):
    """NCCL's barrier blocks the host until the device has run it; Lightning's ``_sync_ddp`` puts one before every
    ``self.log(..., sync_dist=True)`` (seen on an H100 under CUDA's sync debug mode). The strategy's reduce is the
    all-reduce alone."""
    import torch.distributed as dist

    from lightning_seqpar.lightning.process_group import reduce

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with counting_host_reads() as reads:
            dist.barrier()
        assert (reads.barriers, reads.total) == (1, 1)
        with counting_host_reads() as reads:
            mean = reduce(torch.tensor([3.0, 5.0]), reduce_op="mean")
            total = reduce(torch.tensor([7]), reduce_op="sum")
        assert reads.total == 0 and mean.tolist() == [3.0, 5.0] and total.tolist() == [7]
        with pytest.raises(ValueError, match="reduce_op='median'"):
            reduce(torch.ones(1), reduce_op="median")
    finally:
        dist.destroy_process_group()
