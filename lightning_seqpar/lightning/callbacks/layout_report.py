"""``LayoutReport``: the layout and the planner's predicted per-rank peak when fitting starts, the measured peak beside
it when fitting ends.

The prediction is :func:`lightning_seqpar.plan.predict` for the run's own layout (tp, pp, virtual stages, dp, ZeRO,
micro-batch, recomputation, precision) at the run's sequence length and batch, of the model rebuilt from its config on
the meta device (PEFT-wrapped as the run is; the reference GPT as the GPT-2 layout of its sizes), with the activation
bytes of a layer measured on small copies of the model and scaled (the planner's probes: Table 2's formula left out
what an implementation keeps beyond it, such as autocast's 16-bit weight copies; on an H100 it predicted 20.08 GB
where Llama-3-8B at tp 8, s 8192 peaked at 27.73 GB). The measured peak is
the device's (``torch.cuda.max_memory_allocated``: bytes of tensors, comparable with the prediction) on CUDA, and the
process's resident peak (``ru_maxrss``: the interpreter, libraries and data included, an upper bound) on CPU.
Under context parallelism the layout is priced as the planner prices it (a rank's s/c tokens, blockwise attention).
"""

from __future__ import annotations

import resource
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

GB = 1e9


def _planned_model(module: pl.LightningModule) -> Optional[torch.nn.Module]:
    """The module's model rebuilt on the meta device as the planner reads it (``None``: not one it knows).

    Raises:
        ValueError: a model that declares a plan config it cannot be planned as
            (:func:`~lightning_seqpar.lightning.auto_layout.planned_model`).
    """
    from lightning_seqpar.lightning.auto_layout import hf_model_in, planned_model
    from lightning_seqpar.plan.measuring.models import meta_model

    model = hf_model_in(module)
    if model is not None:
        config = model.config.to_dict()
        rebuilt = meta_model(config, getattr(model.config, "_attn_implementation", None) or "eager")
        if getattr(module, "lora", None) is not None and hasattr(module, "with_adapters"):
            with torch.device("meta"):
                rebuilt = module.with_adapters(rebuilt)  # LoRA: the frozen base costs its parameters only
        return rebuilt
    return planned_model(module)  # the reference GPT: the GPT-2 of its sizes


def predicted_peak(trainer: pl.Trainer, module: pl.LightningModule, seq_len: int, batch_size: int) -> tuple[
        Optional[int], str]:
    """``(bytes, how)``: the planner's predicted peak of the most loaded rank for this run, or ``(None, why not)``."""
    from lightning_seqpar.lightning.auto_layout import planned_loss_chunk
    from lightning_seqpar.lightning.memory_callbacks import run_memory_choices
    from lightning_seqpar.plan import Hardware, LayoutRecord, inventory_of_hf_model, predict

    strategy = trainer.strategy
    mesh = getattr(strategy, "mesh", None)
    if mesh is None:
        return None, "not under SeqParallelStrategy"
    try:
        model = _planned_model(module)
    except (ValueError, ImportError) as refusal:  # a report, not a reason to stop the run
        return None, str(refusal)
    if model is None:
        return None, f"the planner does not know {type(module).__name__}'s model"
    layout = strategy.layout  # the run's: its memory choices read from the run's callbacks (layout_of_run)
    choices = run_memory_choices(trainer.callbacks)
    if choices is not None and choices[2] is None:
        return None, "the offload is planned from its budget at the first batch, after this prediction"
    if layout.cp > 1 and layout.recompute == "selective":  # blockwise attention under cp: the callback leaves it
        layout = layout.replace(recompute="none")
    m = layout.pipeline.num_microbatches if layout.pp > 1 else 1
    # Priced as the run trains: the loss chunk the model's loss uses, m micro-batches (the canonical pipeline's).
    record = LayoutRecord(layout.replace(loss_chunk=planned_loss_chunk(module, layout), num_microbatches=m,
                                         virtual_stages=layout.pipeline.virtual_stages), mesh.dp,
                          max(1, batch_size // m))
    precision = str(trainer.precision)
    inventory, batch = inventory_of_hf_model(model), batch_size * mesh.dp * trainer.accumulate_grad_batches
    options = dict(hardware=Hardware(memory=1e15), precision=precision if precision != "64-true" else "32-true")
    # The planner's probes run small copies of the model on CPU, seeded: the run's own generators are put back.
    with torch.random.fork_rng(devices=[]):
        try:
            predict(inventory, record, seq_len, batch, **options)
            how = "activations measured on small copies"
        except Exception as error:  # noqa: BLE001 - a report never stops training: Table 2's formula instead, said
            predict(inventory, record, seq_len, batch, calibrate=False, **options)
            how = f"Table 2's activations: the probes failed ({type(error).__name__}: {error})"
    how += ", float32 bytes for float64" if precision == "64-true" else ""
    if record.reason is not None and not record.bytes:
        return None, f"the planner refuses the layout: {record.reason}"
    if record.host:
        how += f"; {record.host['held'] / GB:.3f} GB offloaded to host memory at the peak"
    return record.bytes.get("total"), how


def measured_peak(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: CUDA's peak of allocated tensor bytes, or the process's resident peak on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS of the process (an upper bound)"


class LayoutReport(pl.Callback):
    """Logs (rank 0) ``layout: Layout(tp=…, pp=…, …) dp=…; predicted peak per rank X GB`` when fitting starts and
    ``peak memory: measured X GB (how) vs predicted Y GB`` when it ends.

    Args:
        seq_len: s, tokens per sequence of the training batches.
        batch_size: sequences per data-parallel rank and micro-batch step (the loader's batch).

    Attributes:
        predicted: the prediction in bytes (``None`` where the planner cannot give one); measured: the peak at the end.
        layout: the strategy's :class:`~lightning_seqpar.Layout` the run trained with (logged as Python to paste).
    """

    def __init__(self, seq_len: int, batch_size: int) -> None:
        self.seq_len, self.batch_size = seq_len, batch_size
        self.predicted: Optional[int] = None
        self.measured: Optional[int] = None
        self.layout: Optional[Any] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mesh = getattr(trainer.strategy, "mesh", None)
        self.layout = getattr(trainer.strategy, "layout", None)
        layout = (f"{self.layout} dp={mesh.dp}" if mesh is not None and self.layout is not None
                  else f"{trainer.world_size} process(es), no model parallelism")
        try:
            self.predicted, how = predicted_peak(trainer, pl_module, self.seq_len, self.batch_size)
        except (ValueError, NotImplementedError) as error:  # a model the planner refuses: said, not fatal
            self.predicted, how = None, f"the planner cannot price it ({error})"
        said = (f"predicted peak per rank {self.predicted / GB:.3f} GB ({how})" if self.predicted is not None
                else f"no predicted peak: {how}")
        rank_zero_info(f"layout: {layout} (world {trainer.world_size}, {trainer.precision}, s={self.seq_len}, "
                       f"b={self.batch_size} per data-parallel rank); {said}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the strategy's device: by fit's end the teardown has moved the module back to the CPU
        self.measured, what = measured_peak(trainer.strategy.root_device)
        versus = f" vs predicted {self.predicted / GB:.3f} GB" if self.predicted is not None else ""
        rank_zero_info(f"peak memory of rank 0: measured {self.measured / GB:.3f} GB ({what}){versus}")
