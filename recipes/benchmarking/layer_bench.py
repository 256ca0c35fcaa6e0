"""Time, activation bytes and communication of one transformer layer: ours (Table 4's configurations)
and torch-native TP + SP, on the same shapes, in the same processes."""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from recipes.benchmarking.comm_counter import CollectiveCounter
from recipes.benchmarking.native_tp import NativeBlock, parallelize_native
from recipes.benchmarking.processes import run_on_processes
from lightning_seqpar.memory.activations import TransformerShape, layer_activation_bytes
from lightning_seqpar.memory.layer_memory import LayerMemory
from lightning_seqpar.memory.tracker import LiveActivationTracker
from lightning_seqpar.models.gpt import Block, GPTConfig
from lightning_seqpar.models.parallel_gpt import parallel_gpt_block
from lightning_seqpar.parallel.collectives import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.rewriting import RewriteContext

# Table 4's rows: name → (sequence parallel, recompute)
TABLE_4 = {
    "baseline (no recompute)": (False, "none"),
    "sequence parallel": (True, "none"),
    "full recompute": (False, "full"),
    "selective recompute": (False, "selective"),
    "selective + sequence parallel": (True, "selective"),
}


@dataclass(frozen=True)
class LayerResult:
    """One row of the benchmark table: a library and configuration, its times, bytes kept and sent."""

    library: str
    configuration: str
    forward_ms: float
    """median forward time of one layer (milliseconds)"""
    backward_ms: float
    """median backward time, recomputation included (milliseconds)"""
    kept_bytes: int
    """bytes the layer's forward leaves alive for backward on rank 0 (live-storage tracker)"""
    model_bytes: float
    """Table 2's figure for the configuration (16-bit layout scaled to the run's element size)"""
    comm_bytes: int
    """bytes rank 0 sends in one forward + backward (ring model)"""

    @property
    def combined_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _time(layer: torch.nn.Module, make_input: Callable[[], torch.Tensor], warmup: int, iters: int,
          device: torch.device) -> tuple[float, float]:
    forward, backward = [], []
    for i in range(warmup + iters):
        x = make_input()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        y = layer(x)
        sync()
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            forward.append(1e3 * (t1 - t0))
            backward.append(1e3 * (t2 - t1))
    return statistics.median(forward), statistics.median(backward)


def _kept_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    with LiveActivationTracker(layer) as tracker:
        y = layer(x)
    kept = tracker.live_bytes()
    del y
    return kept


def _ours(cfg: dict, group: ParallelGroup, device: torch.device, dtype: torch.dtype) -> list[LayerResult]:
    s, b, h, a, f, t = cfg["s"], cfg["b"], cfg["h"], cfg["a"], cfg["ffn"], group.size
    shape = TransformerShape(s=s, b=b, h=h, a=a, ffn_hidden_size=f)
    out = []
    for name, (sp, recompute) in TABLE_4.items():
        torch.manual_seed(0)
        ctx = RewriteContext(group, sp, RNGTracker.for_tensor_parallel(0, group.rank, device), True)
        block = Block(GPTConfig(n_embd=h, n_head=a, block_size=s, dropout=cfg["dropout"], ffn_hidden_size=f))
        layer = parallel_gpt_block(block, ctx).to(device, dtype).train()
        full = recompute == "full"
        layer.set_memory(LayerMemory(whole=full, checkpoints_itself=full,
                                     recompute=frozenset({"core_attn"} if recompute == "selective" else ())))
        local_s = s // t if sp else s
        make = lambda: torch.randn(local_s, b, h, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
        fwd, bwd = _time(layer, make, cfg["warmup"], cfg["iters"], device)
        kept = _kept_bytes(layer, make())
        group.log = CommunicationLog()
        layer(make()).sum().backward()
        comm = group.log.bytes_moved()
        group.log = None
        model = layer_activation_bytes(shape, t, sp, recompute, bytes_per_element=dtype.itemsize)
        out.append(LayerResult("lightning_seqpar", name, fwd, bwd, kept, model, comm))
    return out


def _native(cfg: dict, device: torch.device, dtype: torch.dtype) -> LayerResult:
    from torch.distributed.device_mesh import init_device_mesh

    s, b, h, a, f, t = cfg["s"], cfg["b"], cfg["h"], cfg["a"], cfg["ffn"], dist.get_world_size()
    mesh = init_device_mesh(device.type, (t,))
    torch.manual_seed(0)
    layer = parallelize_native(NativeBlock(h, a, f, cfg["dropout"]).to(device, dtype), mesh).train()
    make = lambda: torch.randn(b, s // t, h, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    fwd, bwd = _time(layer, make, cfg["warmup"], cfg["iters"], device)
    kept = _kept_bytes(layer, make())
    with CollectiveCounter(t) as counter:
        layer(make()).sum().backward()
    shape = TransformerShape(s=s, b=b, h=h, a=a, ffn_hidden_size=f)
    model = layer_activation_bytes(shape, t, True, "none", bytes_per_element=dtype.itemsize)
    return LayerResult("torch-native TP+SP", "sequence parallel", fwd, bwd, kept, model, counter.log.bytes_moved())


def _worker(rank: int, world: int, port: int, cfg: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bf16": torch.bfloat16, "fp32": torch.float32}[cfg["dtype"]]
    try:
        results = _ours(cfg, ParallelGroup(dist.group.WORLD), device, dtype) + [_native(cfg, device, dtype)]
        if rank == 0:
            meta = {"device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
                    "dtype": str(dtype).replace("torch.", ""), "t": world}
            (Path(out_dir) / "results.pkl").write_bytes(pickle.dumps((meta, [asdict(r) for r in results])))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # done: gloo's threads abort a finished process now and then in interpreter teardown (SIGABRT)


def run_layer_benchmark(cfg: dict[str, Any]) -> tuple[dict, list[LayerResult]]:
    """Spawn ``cfg["tp"]`` processes (NCCL on as many GPUs, else gloo on CPU) and measure every row.

    ``cfg``: tp, s, b, h, a, ffn (None: 4h), dropout, dtype ("auto" | "bf16" | "fp32"), warmup, iters.

    Raises:
        ValueError: heads, FFN width or sequence length not divisible by tp.
    """
    cfg = dict(cfg)
    cfg["ffn"] = cfg.get("ffn") or 4 * cfg["h"]
    for key in ("a", "ffn", "s"):
        if cfg[key] % cfg["tp"]:
            raise ValueError(f"{key}={cfg[key]} is not divisible by tp={cfg['tp']}; pick sizes that split.")
    meta, rows = run_on_processes(_worker, cfg["tp"], cfg["tp"], cfg, "results.pkl")
    return meta, [LayerResult(**r) for r in rows]
