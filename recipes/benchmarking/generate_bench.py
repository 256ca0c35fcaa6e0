"""Generation in the training layout against transformers' ``generate`` in one process, on one Qwen3-MoE.

Each layout runs in processes of its own (gloo on CPU; NCCL when there are as many GPUs): a Lightning run of the
strategy at that layout (one optimizer step at learning rate 0, so the weights stay the initial ones), whose callback
then times :func:`lightning_seqpar.generate` (greedy, ``b`` prompts of ``s`` tokens, ``n`` new tokens):

- prefill tokens/s: ``b·s`` over the seconds of a generation of 1 token (the prompt's forward and one choice);
- decode tokens/s: ``b·(n − 1)`` over the seconds the other ``n − 1`` tokens add (the median over ``iters`` pairs of a
  generation of 1 token and one of n, each pair run back to back);
- the key/value cache bytes on rank 0 after ``s + n − 1`` positions
  (:func:`~lightning_seqpar.memory.kv_cache.kv_cache_bytes` of its layers);
- the collectives rank 0 runs for one decoded token (counted), in its tensor-parallel group (an all-reduce per
  row-parallel projection: two per dense layer, one per mixture-of-experts layer, whose experts reduce nothing over
  tp; the embedding's all-reduce, the logits' all-gather over the vocabulary, the token's broadcast), its
  expert-parallel group (the dispatch and combine) and between pipeline stages (the activations it sends).

The row of transformers runs ``model.generate`` on the same model in one process (``DynamicCache``).
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipes.benchmarking.processes import run_in_process_group, run_on_processes


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    transformers: bool = False  # transformers' own generate in one process

    @property
    def name(self) -> str:
        if self.transformers:
            return "transformers generate (1 process)"
        parts = [f"{k} {v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if v > 1] or ["tp 1"]
        return " x ".join(parts) + f" ({self.world} process{'es' if self.world > 1 else ''})"


LAYOUTS = (Layout(1, transformers=True), Layout(1), Layout(2, tp=2), Layout(2, pp=2), Layout(4, tp=2, ep=2))


@dataclass
class GenerateResult:
    layout: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    cache_bytes_rank0: int
    collectives_per_token: dict


def _config(cfg: dict[str, Any]) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], intermediate_size=4 * cfg["hidden"],
                          moe_intermediate_size=cfg["expert_width"], num_experts=cfg["experts"],
                          num_experts_per_tok=cfg["top_k"], num_hidden_layers=cfg["layers"],
                          num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                          max_position_embeddings=cfg["s"] + cfg["n"], attn_implementation="sdpa")


def _prompts(cfg: dict[str, Any], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg["vocab_size"], (cfg["b"], cfg["s"]), generator=g).to(device)


def _seconds(one: Any, whole: Any, device: torch.device, iters: int) -> tuple[float, float]:
    """The median seconds of ``one()`` (a generation of 1 token: the prefill) and of what ``whole()`` (n tokens) takes
    beyond it, measured in pairs after one warm-up pair (so a load that changes between them cancels in each pair)."""
    def timed(run: Any) -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    pairs = [(timed(one), timed(whole)) for _ in range(iters + 1)][1:]
    return statistics.median(p for p, _ in pairs), statistics.median(w - p for p, w in pairs)


def _transformers(cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(cfg)).to(device).eval()
    prompts = _prompts(cfg, device)

    def run(n: int):
        return lambda: model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0)

    first, decode = _seconds(run(1), run(cfg["n"]), device, cfg["iters"])
    config = model.config
    from lightning_seqpar.memory.kv_cache import kv_cache_bytes, layer_windows

    cache = kv_cache_bytes(cfg["b"], cfg["s"] + cfg["n"] - 1, config.num_key_value_heads,
                           config.hidden_size // config.num_attention_heads, 1, 4, layer_windows(config))
    _write(out_dir, GenerateResult("transformers generate (1 process)", cfg["b"] * cfg["s"] / first,
                                   cfg["b"] * (cfg["n"] - 1) / decode, cache, {}))


def _write(out_dir: str, result: GenerateResult) -> None:
    (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(asdict(result)))


def _strategy_run(layout: Layout, cfg: dict[str, Any], device: torch.device, out_dir: str) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_seqpar import SeqParallelStrategy, generate
    from lightning_seqpar.memory.kv_cache import kv_cache_bytes, layer_windows
    from lightning_seqpar.parallel import CommunicationLog

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_config(_config(cfg))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Measure(pl.Callback):
        def on_train_end(self, trainer, module):
            prompts = _prompts(cfg, module.device)
            run = lambda n: lambda: generate(module, prompts, n)  # noqa: E731
            first, decode = _seconds(run(1), run(cfg["n"]), device, cfg["iters"])
            mesh, stage = trainer.strategy.mesh, trainer.strategy.pipeline
            groups = {"": mesh.tensor, " (ep)": mesh.group("ep") if layout.ep > 1 else None}
            counts = []
            for n in (1, 2):  # one decode step: the difference
                for group in groups.values():
                    if group is not None:
                        group.log = CommunicationLog()
                sends = len(stage.executor.transport.log.payload) if stage is not None else 0
                generate(module, prompts, n)
                kinds = [r.kind + suffix for suffix, group in groups.items() if group is not None
                         for r in group.log.records]
                if stage is not None:
                    kinds += ["pipeline send"] * (len(stage.executor.transport.log.payload) - sends)
                counts.append(kinds)
                for group in groups.values():
                    if group is not None:
                        group.log = None
            per_token = {kind: counts[1].count(kind) - counts[0].count(kind) for kind in set(counts[1])}
            config = module.model.config
            stage = trainer.strategy.pipeline
            held = layer_windows(config)
            if stage is not None:
                runtime = stage.executor.runtime
                held = [held[i] for s in runtime.layout.stages_of(stage.pipeline.rank)
                        for i in range(*runtime.layout.bounds(s))]
            cache = kv_cache_bytes(cfg["b"], cfg["s"] + cfg["n"] - 1, config.num_key_value_heads,
                                   config.hidden_size // config.num_attention_heads, layout.tp, 4, held)
            if dist.get_rank() == 0:
                _write(out_dir, GenerateResult(layout.name, cfg["b"] * cfg["s"] / first,
                                               cfg["b"] * (cfg["n"] - 1) / decode, cache,
                                               {k: v for k, v in sorted(per_token.items()) if v}))

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(layout.world), LOCAL_RANK=str(dist.get_rank()),
                      NODE_RANK="0")
    batches = DataLoader([_prompts(cfg, torch.device("cpu"))[0]] * 2 * layout.world, batch_size=2)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=layout.world, max_steps=1,
                         strategy=SeqParallelStrategy(tp=layout.tp, pp=layout.pp, ep=layout.ep), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Measure()])
    trainer.fit(Module(), batches)


def _worker(local_rank: int, layout: Layout, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    if layout.transformers:
        run_in_process_group(local_rank, 1, port, lambda device: _transformers(cfg, device, out_dir))
    run_in_process_group(local_rank, layout.world, port, lambda device: _strategy_run(layout, cfg, device, out_dir))


def run_generate_benchmark(cfg: dict[str, Any], layouts: tuple[Layout, ...] = LAYOUTS) -> list[GenerateResult]:
    """Every layout in fresh processes; rank 0's results in order. ``cfg``: vocab_size, hidden, layers, heads,
    kv_heads, experts, expert_width, top_k, b, s, n, iters.

    Raises:
        ValueError: ``experts`` not divisible by a layout's ep, ``heads``/``kv_heads`` by its tp, or ``layers`` by its
            pp.
    """
    for layout in layouts:
        if cfg["experts"] % layout.ep or cfg["kv_heads"] % layout.tp or cfg["heads"] % layout.tp \
                or cfg["layers"] % layout.pp or cfg["n"] < 2:
            raise ValueError(f"{layout.name}: experts={cfg['experts']} must divide by ep, heads={cfg['heads']} and "
                             f"kv_heads={cfg['kv_heads']} by tp, layers={cfg['layers']} by pp, and n >= 2.")
    return [GenerateResult(**run_on_processes(_worker, layout.world, layout, cfg)) for layout in layouts]
