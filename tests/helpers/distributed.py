"""Run a function on N local processes over gloo and collect what each returns.

Workers are forked from one server process that imported torch, Lightning and this library once (multiprocessing's
forkserver with a preload): a spawned worker would spend seconds importing them again, for every group of every
test. The server is a fresh process, not a fork of the test runner, so workers start from a clean state.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# The Hugging Face modules most tests build (Llama above all) are imported lazily by the library, so each worker would
# import them again; in the server they are imported once. A missing optional extra is skipped by the server.
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_seqpar", "tests.helpers.models",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "peft"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )
    torch.set_num_threads(1)
    # What the server imported is never garbage: kept out of every collection, a full one (StepPeak runs one per fit)
    # scans only what the test made, not the hundreds of thousands of objects of torch, Lightning and transformers.
    gc.freeze()
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        (out / f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # gloo workers can abort in interpreter teardown; the work is done


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process with gloo initialized."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = sorted(Path(out_dir).glob("*.err"))
        if errors:
            raise AssertionError("\n".join(f"rank {e.stem}:\n{e.read_text()}" for e in errors))
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"workers exited with {[p.exitcode for p in procs]} (timeout {timeout}s?)")
        return [pickle.loads((Path(out_dir) / f"{r}.pkl").read_bytes()) for r in range(world_size)]
