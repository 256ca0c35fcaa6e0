"""A Hugging Face Qwen3-MoE on 4 processes under expert parallelism: experts whole on every rank (ep 1) against the
experts split over 2 and 4 ranks, with tensor parallelism 2 (and at tp 1), and over 2 ranks with each expert's width
over 2 more (ep 2 × expert_tp 2: every pair sent to both halves of its expert).

Each layout runs in processes of its own (gloo on CPU; NCCL when there are as many GPUs) on the same model (random
init, float32) and token batches, called as users call it (``model(input_ids=x, labels=x)``). Per layout, on rank 0:

- tokens per second over the timed steps (forward, backward, AdamW; every data-parallel replica its own batch of
  ``b × s`` tokens; the gradient reduction over replicas is not part of the step here);
- the bytes rank 0 sent per step by the expert dispatch (``all_to_all_v``, the (token, expert) pairs leaving it × h ×
  4 bytes, forward and backward) and its split-size exchanges (``all_to_all``), and by tensor parallelism;
- the expert parameters each rank holds.

Two rows fine-tune with LoRA (PEFT, r ``lora_r``, the base frozen) at tp 2 × ep 2: on the attention projections only,
and on the experts' packed weights too (``target_parameters``, :mod:`lightning_seqpar.transformer.expert_lora`); their
last column is the adapter bytes rank 0 holds (float32).

And one row of transformers' own expert parallelism on the same model and token batches
(``from_pretrained(..., distributed_config=DistributedConfig(ep_size=2, fsdp_size=4, ep_implementation="all_to_all"))``:
experts split over 2 ranks, everything FSDP-sharded over the 4, every rank its own batch; transformers 5.24 has no
tensor-parallel plan for Qwen3-MoE, so this is its nearest layout to tp 2 × ep 2); its bytes are not counted here.
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

WORLD = 4
KINDS = ("all_to_all_v", "all_to_all", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int
    transformers: bool = False  # transformers' own expert parallelism (fsdp WORLD × ep), not the strategy's
    etp: int = 1  # expert tensor parallelism: each expert's width over etp ranks
    lora: str = ""  # "": full training; "attention": LoRA on q/k/v/o; "experts": and on the experts' packed weights

    @property
    def name(self) -> str:
        if self.transformers:
            return f"transformers: fsdp {WORLD} x ep {self.ep} (all_to_all)"
        width = f" x expert_tp {self.etp}" if self.etp > 1 else ""
        lora = {"": "", "attention": ", LoRA on attention", "experts": ", LoRA on attention and experts"}[self.lora]
        return f"tp {self.tp} x ep {self.ep}{width} (dp {WORLD // self.tp}){lora}"


LAYOUTS = (Layout(2, 1), Layout(2, 2), Layout(2, 2, etp=2), Layout(2, 4), Layout(1, 4),
           Layout(2, 2, lora="attention"), Layout(2, 2, lora="experts"), Layout(1, 2, transformers=True))
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class MoEResult:
    layout: str
    tokens_per_s: float
    sent_kib: dict
    expert_params_per_rank: int
    adapter_bytes_per_rank: int = 0


def _model(cfg: dict[str, Any], device: torch.device, lora: str = "") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], intermediate_size=4 * cfg["hidden"],
                            moe_intermediate_size=cfg["expert_width"], num_experts=cfg["experts"],
                            num_experts_per_tok=cfg["top_k"], num_hidden_layers=cfg["layers"],
                            num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                            max_position_embeddings=cfg["s"], attn_implementation="sdpa")
    holder = torch.nn.Module()
    holder.model = AutoModelForCausalLM.from_config(config).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if lora == "experts" else None
        holder.model = get_peft_model(holder.model, LoraConfig(r=cfg["lora_r"], lora_alpha=2 * cfg["lora_r"],
                                                               target_modules=ATTENTION, target_parameters=experts))
    return holder


def _run(layout: Layout, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    from lightning_seqpar.parallel import CommunicationLog, ParallelMesh, RNGTracker
    from lightning_seqpar.parallel.dims import ParallelDims
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.rewriting import RewriteContext

    mesh = ParallelMesh.build(dims=ParallelDims(WORLD, tp=layout.tp, ep=layout.ep, etp=layout.etp))
    holder = _model(cfg, device, layout.lora)
    rng = RNGTracker.for_tensor_parallel(0, mesh.tensor.rank, device)
    width = mesh.group("etp") if layout.etp > 1 else None
    rewrite(holder, RewriteContext(mesh.tensor, True, rng, True, expert_group=mesh.group("ep"), data_group=mesh.data,
                                   expert_tp_group=width, expert_dispatch_group=mesh.group("etp_ep") if width else None))
    optimizer = torch.optim.AdamW([p for p in holder.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(mesh.batch_rank)  # every replica its own tokens
    batches = [torch.randint(0, cfg["vocab_size"], (cfg["b"], cfg["s"]), generator=g).to(device)
               for _ in range(cfg["warmup"] + cfg["iters"] + 1)]
    times = timed_steps(holder.model, optimizer, batches[:-1], cfg["warmup"], device)
    groups = (mesh.tensor, mesh.group("etp_ep" if layout.etp > 1 else "ep"))
    for group in groups:
        group.log = CommunicationLog()
    holder.model(input_ids=batches[-1], labels=batches[-1]).loss.backward()
    sent = {kind: sum(group.log.bytes_moved(kind) for group in groups if group.size > 1) / 1024 for kind in KINDS}
    experts = sum(p.numel() for n, p in holder.named_parameters() if ".experts." in n and ".lora_" not in n)
    adapters = sum(p.numel() * p.element_size() for n, p in holder.named_parameters() if ".lora_" in n)
    if dist.get_rank() == 0:
        replicas = WORLD // layout.tp
        result = MoEResult(layout.name, replicas * cfg["b"] * cfg["s"] / statistics.median(times), sent, experts,
                           adapters)
        (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(result)))


def _run_transformers(layout: Layout, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    directory = Path(out_dir) / "model"
    if dist.get_rank() == 0:  # the same weights as the strategy's rows, through a directory as from_pretrained reads
        _model(cfg, torch.device("cpu")).model.save_pretrained(directory)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa",
                                                 distributed_config=DistributedConfig(
                                                     ep_size=layout.ep, fsdp_size=WORLD, tp_size=1,
                                                     ep_implementation="all_to_all"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())  # every rank its own tokens (fsdp is data parallel)
    batches = [torch.randint(0, cfg["vocab_size"], (cfg["b"], cfg["s"]), generator=g).to(device)
               for _ in range(cfg["warmup"] + cfg["iters"])]
    times = timed_steps(model, optimizer, batches, cfg["warmup"], device)
    experts = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                  for n, p in model.named_parameters() if ".experts." in n)
    if dist.get_rank() == 0:
        result = MoEResult(layout.name, WORLD * cfg["b"] * cfg["s"] / statistics.median(times), {}, experts)
        (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(result)))


def _worker(local_rank: int, layout: Layout, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    run = _run_transformers if layout.transformers else _run
    run_in_process_group(local_rank, WORLD, port, lambda device: run(layout, cfg, device, out_dir))


def run_moe_benchmark(cfg: dict[str, Any], layouts: tuple[Layout, ...] = LAYOUTS) -> list[MoEResult]:
    """Every layout in 4 fresh processes; rank 0's results in order. ``cfg``: vocab_size, hidden, layers, heads,
    kv_heads, experts, expert_width, top_k, b, s, warmup, iters, lora_r.

    Raises:
        ValueError: ``experts`` not divisible by a layout's ep, or ``s`` by its tp.
    """
    for layout in layouts:
        if cfg["experts"] % layout.ep or cfg["s"] % layout.tp:
            raise ValueError(f"experts={cfg['experts']} must divide by ep and s={cfg['s']} by tp ({layout.name}).")
    return [MoEResult(**run_on_processes(_worker, WORLD, layout, cfg)) for layout in layouts]
