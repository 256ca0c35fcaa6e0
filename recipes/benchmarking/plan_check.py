"""The planner's step time and peak bytes against measurement, on the machine at hand.

One group of processes:
1. measures this machine's rates (:func:`lightning_seqpar.plan.measuring.calibrate.measure_rates`);
2. on rank 0, ranks every layout of a small Llama (``family: llama``) or Qwen3-MoE (``family: qwen3_moe``: its
   expert-parallel and expert tensor-parallel sizes searched too), in full or with LoRA adapters on q and v
   (``lora_r > 0``: the base frozen), on those processes with that calibration (:func:`lightning_seqpar.plan.plan`,
   a layer's activations probed on small copies as the planner's CLI does): tensor, context (ring), pipeline (1F1B,
   interleaved, ZB-H1, ZB-V) and data parallelism, ZeRO, micro-batches and recomputation. It takes the ``top`` best
   and ``lower`` more, evenly spaced down the ranking, or the ``layouts`` named as the table prints them;
3. trains each one with ``SeqParallelStrategy`` for ``steps`` optimizer steps. Its measured time is the median over the
   steps after ``warmup``, slowest rank. Its measured peak is the largest rank's peak of live tensor bytes over the
   second step (a warm-up step, so the measuring does not slow a timed one;
   :class:`~lightning_seqpar.lightning.callbacks.StepPeak`, CUDA's autocast rules applied on CPU under
   ``bf16-mixed``), against the planner's most loaded rank.

Each row has the layout, its planned rank, the predicted and measured seconds per step and peak bytes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recipes.benchmarking.processes import run_in_process_group, run_on_processes


@dataclass(frozen=True)
class CheckRow:
    """One layout: the planner's rank (1 = best) among the runnable layouts, predicted and measured s per step."""

    layout: str
    planned_rank: int
    predicted_s: float
    measured_s: float
    timing: str
    predicted_peak: float = 0.0
    """bytes, the planner's most loaded rank"""
    measured_peak: float = 0.0
    """bytes, the largest rank's"""


def _llama(cfg: dict[str, Any]):
    """The model's config: a Llama, or a Qwen3-MoE (``family: qwen3_moe``, every layer ``experts`` experts of width
    ``expert_width``, top ``top_k``)."""
    import transformers

    common = dict(attn_implementation="eager", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"],
                  intermediate_size=cfg["ffn"], num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                  num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["s"], pad_token_id=None,
                  bos_token_id=None, eos_token_id=None)
    if cfg.get("family", "llama") == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=cfg["expert_width"],
                                           num_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"],
                                           norm_topk_prob=True, head_dim=cfg["hidden"] // cfg["heads"])
    if cfg.get("family", "llama") != "llama":
        raise ValueError(f"family={cfg['family']!r}: llama or qwen3_moe.")
    return transformers.LlamaConfig(**common)


def _built(cfg: dict[str, Any]):
    """The model the run trains and the planner prices: with ``lora_r > 0``, LoRA adapters on q and v (PEFT)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(_llama(cfg))
    if cfg.get("lora_r", 0):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg["lora_r"], lora_alpha=2 * cfg["lora_r"],
                                                 target_modules=["q_proj", "v_proj"]))
    return model


def _chosen(cfg: dict[str, Any], world: int, calibration: Any) -> list[tuple[int, Any]]:
    """``(planned rank, record)`` of the layouts to run: the top ones and ``lower`` more spread down the ranking."""
    from lightning_seqpar.plan import Hardware, inventory_of_hf_model, plan
    from lightning_seqpar.pipeline_parallel.schedules import SEARCHED_SCHEDULES

    with torch.device("meta"):
        model = _built(cfg)
    records = plan(inventory_of_hf_model(model), world, cfg["s"], cfg["global_batch"],
                   hardware=Hardware(memory=cfg.get("gpu_memory") or 1e12, calibration=calibration),
                   precision=cfg["precision"], micro_batches=tuple(cfg["micro_batches"]), schedule=SEARCHED_SCHEDULES,
                   memory_choices=bool(cfg.get("memory_choices", False)))
    runnable = [r for r in records if r.feasible]
    if cfg.get("layouts"):  # named as the table prints them: a row of an earlier table run again
        named = {_describe(r): i for i, r in enumerate(runnable)}
        unknown = [text for text in cfg["layouts"] if text not in named]
        if unknown:
            raise ValueError(f"layouts={unknown}: not among the planner's runnable layouts; name them as the table "
                             f"prints them, e.g. {list(named)[:3]}.")
        return [(named[text] + 1, runnable[named[text]]) for text in cfg["layouts"]]
    top, lower = cfg["top"], cfg["lower"]
    rest = runnable[top:]
    picks = list(range(min(top, len(runnable))))
    if rest and lower:
        step = max(1, len(rest) // lower)
        picks += [top + i for i in range(step - 1, len(rest), step)][:lower]
    return [(i + 1, runnable[i]) for i in picks]


def _describe(r: Any) -> str:
    from lightning_seqpar.pipeline_parallel.schedules import V_SHAPED, splits_backward

    lay = r.layout
    pipeline = f" v {lay.virtual_stages}" if lay.virtual_stages > 1 and lay.schedule not in V_SHAPED else \
        f" {lay.schedule}" if lay.pp > 1 and splits_backward(lay.schedule) else ""
    experts = f" ep {lay.ep}" if lay.ep > 1 else ""
    experts += f" etp {lay.expert_tp}" if lay.expert_tp > 1 else ""
    from lightning_seqpar.plan.pricing.memory_choices import describe

    return (f"tp {lay.tp}{f' cp {lay.cp}' if lay.cp > 1 else ''} pp {lay.pp}{pipeline} dp {r.dp}{experts}"
            f"{' zero 1' if lay.zero else ''} mbs {r.micro_batch}{f' m {lay.num_microbatches}' if lay.pp > 1 else ''} "
            f"{describe(r).replace('|offload ', ', offload ')}")  # (a markdown table's cell: no bar)


def _measure(record: Any, cfg: dict[str, Any], world: int, device: torch.device) -> tuple[float, float]:
    """``(seconds per step, peak bytes)``, each the slowest or largest rank's."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_seqpar import SeqParallelStrategy
    from lightning_seqpar.lightning.callbacks import StepPeak
    from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = _built(cfg)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.starts.append(time.perf_counter())

    dp = record.dp
    per_rank = cfg["global_batch"] // dp
    pipelined = record.layout.pp > 1
    accumulate = 1 if pipelined else per_rank // record.micro_batch
    clock, peak = Clock(), StepPeak(step=1)
    callbacks: list = [clock, peak]  # the layout's recomputation and offload: the strategy adds their callbacks
    if cfg["warmup"] < 2:
        raise ValueError(f"warmup={cfg['warmup']}: at least 2 (the second step's peak is measured, outside the timing).")
    steps = cfg["warmup"] + cfg["steps"] + 1  # one more: the last step's start ends the one before
    strategy = SeqParallelStrategy(layout=record.layout)  # the layout as priced, the planner's own value
    trainer = pl.Trainer(accelerator=device.type, devices=world, precision=cfg["precision"], max_steps=steps,
                         strategy=strategy, accumulate_grad_batches=accumulate, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
    # tensor- and context-parallel peers read the same batch: seeded by the data-parallel rank (the mesh's order,
    # tp fastest, then cp, then dp)
    data_rank = dist.get_rank() // (record.layout.tp * record.layout.cp) % record.dp
    tokens = torch.randint(0, cfg["vocab_size"], (steps * per_rank, cfg["s"]),
                           generator=torch.Generator().manual_seed(data_rank))
    autocast_rules = cuda_autocast_rules() if device.type == "cpu" else contextlib.nullcontext()
    with autocast_rules:  # on CPU, what a GPU computes in float32 under bf16-mixed (softmax, norms), as predicted
        trainer.fit(LM(), DataLoader(TensorDataset(tokens), batch_size=per_rank if pipelined else record.micro_batch))
    starts = clock.starts[::accumulate]  # one start per optimizer step
    seconds = [b - a for a, b in zip(starts, starts[1:])][cfg["warmup"]:]
    slowest = torch.tensor([statistics.median(seconds), float(peak.peak)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0]), float(slowest[1])


def check(rank: int, world: int, cfg: dict[str, Any], device: torch.device) -> list[CheckRow]:
    """Steps 1–3 on this rank of an initialized process group; every rank returns the rows. With
    ``cfg["calibration_out"]`` rank 0 writes the measured rates there (``--calibration`` of the planner's CLI)."""
    from lightning_seqpar.plan.measuring.calibrate import measure_rates

    shared = [measure_rates(rank, world, cfg["repeats"])]
    if rank == 0 and cfg.get("calibration_out"):  # the rates the predictions used, for the planner's CLI to read
        shared[0].save(cfg["calibration_out"])
    dist.broadcast_object_list(shared, src=0)
    chosen = [_chosen(cfg, world, shared[0]) if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    rows = []
    for planned, record in chosen[0]:
        seconds, peak = _measure(record, cfg, world, device)
        rows.append(CheckRow(_describe(record), planned, record.step_time["total"], seconds, record.timing,
                             record.bytes["total"], peak))
    return rows


def _worker(local_rank: int, what: int, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    import os
    import pickle
    from pathlib import Path

    # Lightning reads the launch from the environment; without it the Trainer would launch processes of its own
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(what),
                      LOCAL_WORLD_SIZE=str(what))

    def body(device: torch.device) -> None:
        rows = check(local_rank, what, cfg, device)
        if local_rank == 0:
            (Path(out_dir) / "result.pkl").write_bytes(pickle.dumps(rows))

    run_in_process_group(local_rank, what, port, body)


def run_plan_check(cfg: dict[str, Any]) -> list[CheckRow]:
    """The rows of ``cfg["processes"]`` new processes (gloo on CPU; NCCL where there is a GPU per process)."""
    return run_on_processes(_worker, cfg["processes"], cfg["processes"], cfg)
