"""Run one benchmark row in fresh processes and read back what rank 0 wrote.

The processes are forked from a server that imported torch, torch.distributed, Lightning and this library once
(multiprocessing's forkserver with a preload): spawning each rank re-imported them, about 9 s of CPU per process on 2
cores, which was most of a small row's time. Each row still gets fresh processes (the server is a new interpreter,
not a fork of the caller), and the server never touches CUDA, so every rank initializes its own device as under
spawn (torch: "either the spawn or forkserver start method are required to use CUDA in subprocesses").
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_seqpar"]
"""What the forkserver imports once for every row's processes."""


def run_on_processes(worker: Callable[..., None], world: int, what: Any, cfg: dict[str, Any],
                     result: str = "result.pkl") -> Any:
    """``worker(local_rank, what, port, cfg, out_dir)`` on ``world`` new processes (a free local port for their
    rendezvous); returns the object rank 0 pickled into ``out_dir/result``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts (the first row)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(worker, args=(what, port, cfg, out_dir), nprocs=world, start_method="forkserver")
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


def run_in_process_group(local_rank: int, world: int, port: int, body: Callable[[torch.device], None]) -> None:
    """In a worker: ``body(device)`` inside a process group of ``world`` ranks (NCCL on GPUs, else gloo), then a
    barrier and the group's end; the process exits at once (gloo's threads abort a finished process now and then in
    interpreter teardown)."""
    device = worker_device(local_rank, world, port)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=local_rank, world_size=world)
    try:
        body(device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], warmup: int,
                device: torch.device) -> list[float]:
    """Seconds of each training step (``model(input_ids=x, labels=x)``, backward, ``optimizer.step``) on ``batches``
    after the first ``warmup`` (the device synchronized at each step's end)."""
    times = []
    for step, x in enumerate(batches):
        start = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times
