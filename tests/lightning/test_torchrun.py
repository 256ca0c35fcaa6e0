"""A job started by torchrun on 2 (simulated) nodes × 2 processes trains, checkpoints and resumes."""

import socket
import subprocess
import sys

import pytest

from tests.helpers.jobs import ABORT, ROOT, job_environment

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, *overrides):
    port = _free_port()
    args = ["model=gpt_tiny", "trainer.devices=2", "trainer.num_nodes=2", "strategy.tp=2", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", "sample.max_new_tokens=8",
            f"hydra.run.dir={tmp_path / 'out'}", *overrides]
    env = {**job_environment(), "PYTHONPATH": str(ROOT)}

    def node(rank):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(ROOT / "recipes" / "pretrain_gpt.py"), *args]
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(1), node(0)]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[1][-3000:] + outputs[0][-3000:]
    assert not any(ABORT in out for out in outputs)  # no abort in any process's teardown
    return outputs[1]  # node 0's output


def test_two_torchrun_nodes_train_checkpoint_and_resume(tmp_path):
    first = _two_nodes(tmp_path, "trainer.max_steps=4")
    assert "Starting with 4 processes" in first and "final metrics" in first
    assert (tmp_path / "out" / "checkpoints" / "step000004.ckpt").exists()
    resumed = _two_nodes(tmp_path, "trainer.max_steps=6", f"ckpt_path={tmp_path / 'out' / 'checkpoints' / 'last.ckpt'}")
    assert "Restored all states from the checkpoint" in resumed
    assert (tmp_path / "out" / "checkpoints" / "step000006.ckpt").exists()
