"""``FlopsUtilization``: tokens/s, model and hardware TFLOP/s, MFU and HFU, logged while training."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_seqpar.lightning.strategy import SeqParallelStrategy
from lightning_seqpar.memory.flops import model_flops_per_iteration, recompute_flops
from lightning_seqpar.recompute import micro_batch_shape, model_shape, recompute_counts, rewritten_layers
from lightning_seqpar.tensor_parallel.embedding import VocabParallelEmbedding

# Dense 16-bit peak FLOP/s by device name (vendor data sheets; SXM parts).
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12, "V100": 125e12, "L4": 121e12,
              "A10G": 70e12, "L40S": 362e12}


def peak_flops_of(device: torch.device) -> Optional[float]:
    """The known 16-bit dense peak of ``device`` (FLOP/s), or ``None`` (CPUs, unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def vocabulary_of(module: torch.nn.Module) -> int:
    """v for the output layer's FLOPs: a vocabulary-parallel embedding's (the reference GPT), else the ``vocab_size``
    of a Hugging Face model's config (the same on every pipeline stage, wherever the embedding is), else 0."""
    for sub in module.modules():
        if isinstance(sub, VocabParallelEmbedding):
            return sub.num_embeddings
    for sub in module.modules():
        vocab = getattr(getattr(sub, "config", None), "vocab_size", None)
        if isinstance(vocab, int) and hasattr(sub, "lm_head"):
            return vocab
    return 0


class FlopsUtilization(pl.Callback):
    """Log throughput and FLOPs utilization of every training batch (Korthikanti et al. 2022 §6.3).

    Logged (per batch, on the progress bar's logger): ``perf/tokens_per_s`` (global, all data-parallel
    ranks), ``perf/model_tflops`` and ``perf/hardware_tflops`` (per device, TFLOP/s, Eq. 7 and Eq. 8 with
    this model's recomputation), ``perf/mfu`` and ``perf/hfu`` (fractions; only with a known peak), and
    ``perf/peak_memory_gib`` on CUDA (``torch.cuda.max_memory_allocated``).

    Args:
        peak_flops: the device's peak FLOP/s; default: looked up by CUDA device name (``PEAK_FLOPS``).
        vocab_size: for the output layer's FLOPs; default: :func:`vocabulary_of` the model.

    The model shape comes from the rewritten layers (:func:`~lightning_seqpar.recompute.model_shape`: grouped-query
    attention and gated MLPs included, as the Llama family has them) and each batch's token ids ``[b, s]``.
    """

    def __init__(self, peak_flops: Optional[float] = None, vocab_size: Optional[int] = None) -> None:
        self.peak_flops, self.vocab_size = peak_flops, vocab_size
        self._start: Optional[float] = None
        self._timed: deque = deque()  # CUDA: [start event, end event, batch] of batches not reported yet
        self.last: dict[str, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._timed.append([start, None, batch])
        else:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """On the CPU, time the batch that just ended. On CUDA, record an event and report the newest batch whose
        events the device has passed (``Event.query``, which does not wait): the host never waits for the device,
        and the figures lag the device's progress by a batch or so."""
        if pl_module.device.type == "cuda":
            if not self._timed:
                return
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timed[-1][1] = end
            done = None
            while self._timed and self._timed[0][1] is not None and self._timed[0][1].query():
                done = self._timed.popleft()
            if done is None:
                return
            start, end, batch = done
            seconds = start.elapsed_time(end) / 1e3  # milliseconds
        else:
            if self._start is None:
                return
            seconds = time.perf_counter() - self._start
        self.last = self.measure(trainer, pl_module, batch, seconds)
        pl_module.log_dict(self.last, on_step=True, on_epoch=False)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, seconds: float) -> dict[str, float]:
        """The logged figures for one batch that took ``seconds``."""
        s, b = micro_batch_shape(batch)
        shape, _, _ = model_shape(pl_module, s, b)
        vocab = self.vocab_size if self.vocab_size is not None else vocabulary_of(pl_module)
        shape = replace(shape, v=vocab)
        strategy = trainer.strategy
        ours = isinstance(strategy, SeqParallelStrategy)
        dp = strategy.mesh.dp if ours else trainer.world_size
        world = trainer.world_size
        global_batch = b * dp
        selective, full = recompute_counts(pl_module)
        mlp = sum(1 for layer in rewritten_layers(pl_module) if layer.recompute_mlp)  # recomputed by module
        if ours and strategy.pipeline is not None:  # this stage holds L/p of the layers; the others alike
            total = strategy.pipeline.layout.num_layers
            selective, full, mlp = (n * total // shape.L for n in (selective, full, mlp))
            shape = replace(shape, L=total)
        model = model_flops_per_iteration(shape, global_batch)
        hardware = model + recompute_flops(shape, global_batch, selective, full, mlp)
        out = {
            "perf/tokens_per_s": global_batch * s / seconds,
            "perf/model_tflops": model / seconds / world / 1e12,
            "perf/hardware_tflops": hardware / seconds / world / 1e12,
        }
        device = next(pl_module.parameters()).device
        peak = self.peak_flops or peak_flops_of(device)
        if peak:
            out["perf/mfu"] = model / seconds / world / peak
            out["perf/hfu"] = hardware / seconds / world / peak
        if device.type == "cuda":
            out["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return out
