"""Run one benchmark row in fresh processes and read back what rank 0 wrote."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def run_on_processes(worker: Callable[..., None], world: int, what: Any, cfg: dict[str, Any],
                     result: str = "result.pkl") -> Any:
    """``worker(local_rank, what, port, cfg, out_dir)`` on ``world`` spawned processes (a free local port for their
    rendezvous); returns the object rank 0 pickled into ``out_dir/result``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(what, port, cfg, out_dir), nprocs=world, start_method="spawn")
        return pickle.loads((Path(out_dir) / result).read_bytes())


def worker_device(local_rank: int, world: int, port: int) -> torch.device:
    """In a worker: the rendezvous address, and this rank's device (its GPU when there are ``world`` of them, where it
    becomes the current one; else the CPU, with the cores shared among the ranks)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return device
