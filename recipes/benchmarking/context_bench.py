"""Long sequences on 4 processes: tensor parallelism alone against tensor × context parallelism (ring, all-to-all).

Each layout runs in processes of its own (gloo on CPU; NCCL when there are as many GPUs) on the same Hugging Face
Llama (random init, float32) and the same token batches, called as users call it (``model(input_ids=x, labels=x)``).
Per layout, on rank 0:

- tokens per second over the timed training steps (forward, backward, AdamW);
- the bytes the forward keeps for backward on the rank, measured live (``LiveActivationTracker``), and the bytes
  sent per step for attention across cp ranks (``ring_send``, ``all_to_all``) and by tensor parallelism;
- the longest sequence (doubling from ``s_min``) whose kept bytes per rank stay within ``budget_mib``, each size
  measured, not extrapolated.
"""

from __future__ import annotations

import pickle
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipes.benchmarking.processes import run_in_process_group, run_on_processes, timed_steps


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int = 1
    comm: str = "ring"

    @property
    def world(self) -> int:
        return self.tp * self.cp

    @property
    def name(self) -> str:
        return f"tp {self.tp}" + (f" x cp {self.cp} {self.comm}" if self.cp > 1 else "")


LAYOUTS = (Layout(4), Layout(2, 2, "ring"), Layout(2, 2, "all_to_all"))


@dataclass
class ContextResult:
    layout: str
    tokens_per_s: float
    kept_mib: float
    sent_kib: dict
    longest_s: int


def _model(cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], intermediate_size=4 * cfg["hidden"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["s"],
                         attn_implementation=cfg["attention"])
    holder = torch.nn.Module()
    holder.model = AutoModelForCausalLM.from_config(config).to(device)
    return holder


def _kept_bytes(holder: torch.nn.Module, x: torch.Tensor) -> int:
    from lightning_seqpar.memory.tracker import LiveActivationTracker

    with LiveActivationTracker(holder) as tracker:
        loss = holder.model(input_ids=x, labels=x).loss
    kept = tracker.live_bytes()  # everything the forward left alive: what backward will read
    loss.backward()
    return kept


def _run(layout: Layout, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    from lightning_seqpar.context_parallel import ContextParallel
    from lightning_seqpar.parallel import CommunicationLog, ParallelMesh, RNGTracker
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.rewriting import RewriteContext

    mesh = ParallelMesh.build(layout.tp, 1, device.type, cp=layout.cp)
    holder = _model(cfg, device)
    rng = RNGTracker.for_tensor_parallel(0, mesh.tensor.rank, device)
    rewrite(holder, RewriteContext(mesh.tensor, True, rng, True, context=ContextParallel(mesh.context, layout.comm)))
    optimizer = torch.optim.AdamW(holder.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg["vocab_size"], (cfg["b"], cfg["s"]), generator=g).to(device)
               for _ in range(cfg["warmup"] + cfg["iters"] + 1)]
    times = timed_steps(holder.model, optimizer, batches[:-1], cfg["warmup"], device)
    x = batches[-1]
    for group in (mesh.tensor, mesh.context):
        group.log = CommunicationLog()
    kept = _kept_bytes(holder, x)
    sent = {kind: sum(group.log.bytes_moved(kind) for group in (mesh.tensor, mesh.context)) / 1024
            for kind in ("all_gather", "reduce_scatter", "all_reduce", "ring_send", "all_to_all")}
    for group in (mesh.tensor, mesh.context):
        group.log = None
    holder.zero_grad(set_to_none=True)
    longest, s = 0, cfg["s_min"]
    budget = cfg["budget_mib"] * 2**20
    while s <= cfg["s_max"]:
        probe = torch.randint(0, cfg["vocab_size"], (cfg["b"], s), generator=g).to(device)
        fits = torch.tensor(float(_kept_bytes(holder, probe) <= budget))
        holder.zero_grad(set_to_none=True)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every rank within the budget
        if fits.item() < 1:
            break
        longest, s = s, 2 * s
    if dist.get_rank() == 0:
        result = ContextResult(layout.name, cfg["b"] * cfg["s"] / statistics.median(times), kept / 2**20, sent, longest)
        (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(result)))


def _worker(local_rank: int, layout: Layout, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    run_in_process_group(local_rank, layout.world, port, lambda device: _run(layout, cfg, device, out_dir))


def run_context_benchmark(cfg: dict[str, Any], layouts: tuple[Layout, ...] = LAYOUTS) -> list[ContextResult]:
    """Every layout in fresh processes; rank 0's results in order. ``cfg``: vocab_size, hidden, layers, heads,
    kv_heads, attention, b, s, warmup, iters, s_min, s_max, budget_mib.

    Raises:
        ValueError: ``s`` or ``s_min`` not divisible by ``2·cp·tp`` of a layout.
    """
    for layout in layouts:
        unit = 2 * layout.cp * layout.tp
        if cfg["s"] % unit or cfg["s_min"] % unit:
            raise ValueError(f"s={cfg['s']} and s_min={cfg['s_min']} must be multiples of 2·cp·tp = {unit} "
                             f"({layout.name}).")
    results = []
    for layout in layouts:
        results.append(ContextResult(**run_on_processes(_worker, layout.world, layout, cfg)))
    return results
