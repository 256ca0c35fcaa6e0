"""What only a GPU can show, in one command (about 7 minutes on one H200): memory against the planner, the CUDA
kernels against their op-by-op references, host syncs in a training step, and speed with and without compiled blocks
against plain Lightning + transformers. Prints one table; exits 1 when a check fails.

    python recipes/gpu_check.py           # on a CUDA device
    python recipes/gpu_check.py --cpu     # the dry parts on CPU: the same code at a small size (what CI runs)
    python recipes/gpu_check.py --calibration h200.json   # also keep the step-time row's measured device rates

Rows (each in its own process, so every memory peak and process group is its own):

- ``memory``: one rank of a large world on torch's ``fake`` process-group backend (collectives return at once; the
  rank allocates what it would in the real job) at full size: Llama-3-8B at tp 8, s 8192, bf16-mixed, selective
  recomputation; and tp 4 × cp 2. ``torch.cuda.max_memory_allocated`` against the planner's prediction for that rank
  (:class:`~lightning_seqpar.lightning.callbacks.layout_report.LayoutReport`), within 5 %, with the second step's
  peak in its forward, backward and optimizer step beside it (under cp the selective recomputation callback leaves the
  blockwise attention as it is, and the planner prices it so). On CPU: a tiny Llama, and no device peak.
- ``kernels``: the fused attention kernel with log-sum-exp that context parallelism merges blocks by
  (``_compat.fused_attention_with_lse``), in bf16, against the explicit softmax attention in float32; our first
  training loss (vocabulary-parallel head, the loss over chunks of positions, bf16-mixed) against the same model's
  loss under plain Lightning.
- ``host syncs``: reads of device values (``aten._local_scalar_dense``) inside the strategy's training step and
  backward, steps after the first, counted with a dispatch mode (0 expected: ``docs/gpus.md``).
- ``offload``: the speed row's Llama at 4 layers, three steps without and with ``ActivationOffload`` of every module
  (pinned host memory, a side stream): the losses agree (1e-3 relative on CUDA, whose backward kernels may sum in
  another order; exactly on CPU), the forward's peak falls, no host sync after the first step; bytes moved reported.
- ``speed``: a Llama of about 1B parameters (tp 1, bf16-mixed, selective): tokens/s and MFU (Eq. 7 FLOPs over the
  device's peak) under ``SeqParallelStrategy`` eager, with ``compile=True``, and plain Lightning + transformers on
  the same model and batches. On CPU: a tiny Llama, ``compile={"backend": "aot_eager"}``, no MFU.
- ``step time``: the planner's seconds per step for the eager speed row's layout, from this device's own rates
  (GEMMs, attention, element-wise work, the optimizer step: ``plan.calibrate.measure_device_rates``), against the
  measured median; within 20 % on a GPU, reported on CPU. ``--calibration PATH`` writes those rates as a calibration
  file (one process, no collectives: it plans one-device layouts, ``python -m lightning_seqpar.plan --calibration``).
- ``step times``: the same against three more layouts trained and timed: full recomputation, a long sequence, and a
  small model whose step is the host's dispatch (the time model's regimes).
"""

from __future__ import annotations

import argparse
import json
import os
import multiprocessing
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the package from this checkout

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)
LLAMA_1B = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
SMALL = dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
MEMORY_TOLERANCE = 0.05
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_seqpar", "transformers"]
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK")


@dataclass
class Row:
    check: str
    case: str
    measured: str
    expected: str
    ok: Optional[bool]  # None: reported, not judged (a dry run on CPU, or nothing to compare with)


def _size(cpu: bool, calibration: Optional[str] = None) -> dict:
    """The sizes of every row: full on a GPU, tiny on CPU; ``calibration``: where the step-time row writes the rates
    it measured (None: nowhere)."""
    if cpu:
        return dict(memory=[(TINY, 4, 1, 64), (TINY, 2, 2, 64)], speed=(TINY, 64, 2, 4),
                    compile={"backend": "aot_eager"}, precision="bf16-mixed", device="cpu", calibration=calibration,
                    step_times=[(TINY, 64, 2, "full"), (TINY, 128, 1, "none")])
    # beside the speed row's layout: full recomputation, a long sequence (attention's share up), a small model (the
    # host's dispatch outlasts the device's work)
    return dict(memory=[(LLAMA3_8B, 8, 1, 8192), (LLAMA3_8B, 4, 2, 8192)], speed=(LLAMA_1B, 2048, 4, 10),
                compile=True, precision="bf16-mixed", device="cuda", calibration=calibration,
                step_times=[(LLAMA_1B, 2048, 4, "full"), (LLAMA_1B, 8192, 1, "none"), (SMALL, 512, 1, "none")])


def _trainer(size: dict, steps: int, strategy: Any, callbacks: list, num_nodes: int = 1) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="gpu" if size["device"] == "cuda" else "cpu", devices=1, num_nodes=num_nodes,
                      precision=size["precision"], max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, strategy=strategy, callbacks=callbacks)


def _tokens(vocab: int, s: int, batch: int, steps: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch * steps, s), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=batch)


def _phase_peaks() -> Any:
    """A callback keeping, for the last step, CUDA's peak of allocated bytes in its forward, its backward and its
    optimizer step (the peak statistic reset at each boundary): where a step peaks says which term of the planner's
    prediction to look at when the total disagrees."""
    import lightning.pytorch as pl
    import torch

    class PhasePeaks(pl.Callback):
        def __init__(self) -> None:
            self.peaks: dict[str, int] = {}

        def _phase(self, name: Optional[str]) -> None:
            if not torch.cuda.is_available():
                return
            if name is not None:
                self.peaks[name] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, *args: Any) -> None:
            self._phase(None)

        def on_before_backward(self, *args: Any) -> None:
            self._phase("forward")

        def on_after_backward(self, *args: Any) -> None:
            self._phase("backward")

        def on_train_batch_end(self, *args: Any) -> None:
            self._phase("optimizer")
    return PhasePeaks()


def memory_row(size: dict, index: int) -> Row:
    """One rank of a ``tp · cp``-rank world on the fake backend, two steps; its peak against the planner's."""
    import torch.distributed as dist

    from lightning_seqpar import LaunchConfig, SelectiveRecompute, SeqParallelStrategy
    from lightning_seqpar._compat import fake_process_group_store
    from lightning_seqpar.lightning.callbacks.layout_report import LayoutReport
    from lightning_seqpar.models.hf_module import HFCausalLMModule

    config, tp, cp, s = size["memory"][index]
    world = tp * cp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0",
                      NODE_RANK="0")
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world)
    report, phases = LayoutReport(seq_len=s, batch_size=1), _phase_peaks()
    trainer = _trainer(size, 2, SeqParallelStrategy(tp=tp, cp=cp, launch=LaunchConfig(backend="fake")),
                       [SelectiveRecompute(), report, phases], num_nodes=world)
    trainer.fit(HFCausalLMModule(config=dict(config)), _tokens(config["vocab_size"], s, 1, 2))
    case = f"Llama h={config['hidden_size']} L={config['num_hidden_layers']} tp {tp} cp {cp}, s {s}, rank 0 of {world}"
    if size["device"] != "cuda":
        return Row("memory", case, "trained 2 steps (fake backend)", _gb(report.predicted), None)
    # The second step's phases (the optimizer state exists); the reset at each boundary makes their largest the peak.
    measured = max(phases.peaks.values())
    where = ", ".join(f"{name} {_gb(peak)}" for name, peak in phases.peaks.items())
    if report.predicted is None:
        return Row("memory", case, f"{_gb(measured)} ({where})", "not priced", None)
    error = measured / report.predicted - 1
    return Row("memory", case, f"{_gb(measured)} ({error:+.1%}; {where})", _gb(report.predicted),
               abs(error) <= MEMORY_TOLERANCE)


def _gb(value: Optional[int]) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.2f} MB"


def kernel_rows(size: dict) -> list[Row]:
    """The fused attention with log-sum-exp (bf16) against explicit float32 attention, causal and masked."""
    import torch

    from lightning_seqpar._compat import fused_attention_with_lse

    device = torch.device(size["device"])
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for name, causal in (("causal", True), ("masked block", False)):
        q, k, v = (torch.randn(2, 8, 256, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
        allowed = None if causal else (torch.rand(2, 256, 256, generator=g) > 0.3).to(device)
        out, lse = fused_attention_with_lse(q, k, v, causal, allowed, 64 ** -0.5)
        scores = (q.float() @ k.float().transpose(-2, -1)) * 64 ** -0.5
        mask = torch.ones(256, 256, dtype=torch.bool, device=device).tril() if causal else allowed[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        want_lse = torch.logsumexp(scores, -1)
        want = torch.softmax(scores, -1) @ v.float()
        out_error = ((out.float() - want).abs().max() / want.abs().max()).item()
        lse_error = (lse.float() - want_lse).abs().max().item()
        rows.append(Row("kernels", f"fused attention + lse, bf16, {name}", f"out {out_error:.1e}, lse {lse_error:.1e}",
                        "out ≤ 2e-2 rel, lse ≤ 2e-2", out_error <= 2e-2 and lse_error <= 2e-2))
    return rows


class _Timer:
    """Step times after the warm-up steps (CUDA synchronized at each end: the timer's own, outside the step)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.losses, self._start = warmup, [], [], 0.0

    def callback(self) -> Any:
        import lightning.pytorch as pl
        import torch

        timer = self

        class Timing(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, index):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer._start = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, index):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if index >= timer.warmup:
                    timer.times.append(time.perf_counter() - timer._start)
                timer.losses.append(float(outputs["loss"]))
        return Timing()


def _speed_module(config: dict) -> Any:
    """A user's module around ``AutoModelForCausalLM.from_config`` (built at once, seeded: the same weights under
    every library), its loss from ``labels=``."""
    import lightning.pytorch as pl
    import torch

    from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config

    class SpeedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build_causal_lm(causal_lm_config(dict(config), attn_implementation="sdpa"))

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[1]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)
    return SpeedLM()


def speed_rows(size: dict, library: str) -> list[Row]:
    """Tokens/s and MFU of ``library``: ``ours`` (eager), ``ours compiled`` or ``plain`` Lightning + transformers;
    the first loss is reported for the loss row (the same seeded weights in all three). ``ours`` is followed by the
    planner's step time against its own (:func:`step_time_row`)."""
    import torch

    from lightning_seqpar import RewriteConfig, SelectiveRecompute, SeqParallelStrategy
    from lightning_seqpar.lightning.callbacks.flops_utilization import peak_flops_of
    from lightning_seqpar.memory.activations import TransformerShape
    from lightning_seqpar.memory.flops import model_flops_per_iteration

    config, s, batch, steps = size["speed"]
    module = _speed_module(config)
    timer = _Timer(warmup=2)
    if library == "plain":
        strategy, callbacks = "auto", [timer.callback()]
    else:
        compiled = size["compile"] if library == "ours compiled" else False
        strategy = SeqParallelStrategy(tp=1, rewriting=RewriteConfig(compile=compiled))
        callbacks = [timer.callback(), SelectiveRecompute()]
    _trainer(size, steps, strategy, callbacks).fit(module, _tokens(config["vocab_size"], s, batch, steps))
    step = sorted(timer.times)[len(timer.times) // 2]
    shape = TransformerShape(s=s, b=batch, h=config["hidden_size"], a=config["num_attention_heads"],
                             L=config["num_hidden_layers"], v=config["vocab_size"],
                             ffn_hidden_size=config["intermediate_size"], num_kv_heads=config["num_key_value_heads"],
                             gated_mlp=True)
    peak = peak_flops_of(torch.device(size["device"]))
    mfu = f", MFU {model_flops_per_iteration(shape, batch) / step / peak:.1%}" if peak else ""
    row = Row("speed", f"{library}: Llama h={config['hidden_size']} L={config['num_hidden_layers']}, {batch}x{s}",
              f"{batch * s / step:,.0f} tokens/s{mfu}", f"first loss {timer.losses[0]:.4f}", None)
    return [row, step_time_row(size, step)] if library == "ours" else [row]


def _planned_step(size: dict, calibration: Any, config: dict, s: int, batch: int, recompute: str) -> tuple[float, str]:
    """The planner's seconds per step of a one-device layout (tp 1, one micro-batch of ``batch``, ``recompute``) from
    ``calibration``, and its terms as text."""
    import torch

    from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config
    from lightning_seqpar.plan import Hardware, inventory_of_hf_model, plan

    with torch.device("meta"):
        model = build_causal_lm(causal_lm_config(dict(config), attn_implementation="sdpa"))
    records = plan(inventory_of_hf_model(model), 1, s, batch, hardware=Hardware(memory=1e15, calibration=calibration),
                   precision=size["precision"], micro_batches=(batch,), context_parallel=(1,))
    record = next(r for r in records if r.feasible and r.layout.recompute == recompute
                  and not r.layout.recompute_modules and not r.layout.offload)
    terms = ", ".join(f"{k} {v:.3f}" for k, v in record.step_time.items() if k != "total" and v > 0)
    return record.step_time["total"], terms


def _device_rates(size: dict) -> Any:
    """This device's rates (:func:`~lightning_seqpar.plan.measuring.calibrate.measure_device_rates`), written to
    ``size["calibration"]`` when the command names a file."""
    import torch

    from lightning_seqpar.plan.measuring.calibrate import measure_device_rates

    calibration = measure_device_rates(torch.device(size["device"]))
    if size["calibration"] is not None:
        calibration.save(size["calibration"])
    return calibration


def _judged(size: dict, predicted: float, measured: float) -> Optional[bool]:
    """Within 20 % on a GPU (issue goal); on CPU reported, not judged (a tiny step is mostly Python)."""
    return None if size["device"] == "cpu" else abs(predicted / measured - 1) <= 0.2


def step_time_row(size: dict, measured: float) -> Row:
    """The planner's step time for the speed row's layout (one device, tp 1, one micro-batch of the whole batch, no
    recomputation: under SDPA the selective one has nothing to recompute) from this device's own rates, against
    ``measured`` (the eager run's median seconds per step)."""
    config, s, batch, _ = size["speed"]
    calibration = _device_rates(size)
    predicted, terms = _planned_step(size, calibration, config, s, batch, "none")
    return Row("step time", f"planned with this device's rates ({calibration.describe()}): {terms}",
               f"{measured:.3f} s measured", f"{predicted:.3f} s predicted ({predicted / measured:.2f} of measured)",
               _judged(size, predicted, measured))


def step_time_rows(size: dict) -> list[Row]:
    """More one-device layouts than the speed row's, each trained and timed (median after 2 warm-up steps) and planned
    from this device's rates: full recomputation, a long sequence, a model small enough that the host's dispatch
    outlasts the device's work."""
    from lightning_seqpar import SelectiveRecompute, SeqParallelStrategy

    calibration = _device_rates(size)
    rows = []
    for config, s, batch, recompute in size["step_times"]:
        timer, steps = _Timer(warmup=2), 8
        callbacks = [timer.callback()] + ([SelectiveRecompute(granularity="full")] if recompute == "full" else [])
        _trainer(size, steps, SeqParallelStrategy(tp=1), callbacks).fit(
            _speed_module(config), _tokens(config["vocab_size"], s, batch, steps))
        measured = sorted(timer.times)[len(timer.times) // 2]
        predicted, terms = _planned_step(size, calibration, config, s, batch, recompute)
        rows.append(Row("step time", f"Llama h={config['hidden_size']} L={config['num_hidden_layers']}, {batch}x{s}, "
                        f"{recompute}: {terms}", f"{measured:.3f} s measured",
                        f"{predicted:.3f} s predicted ({predicted / measured:.2f} of measured)",
                        _judged(size, predicted, measured)))
    return rows


def host_sync_row(size: dict) -> Row:
    """Device reads inside the strategy's training step and backward, per step after the first."""
    from lightning_seqpar import HostSyncCounter, SelectiveRecompute, SeqParallelStrategy
    from lightning_seqpar.models.hf_module import HFCausalLMModule

    counter = HostSyncCounter(cuda_sync_debug="error")  # CUDA's own detector too: a synchronizing call raises
    config, s, batch, _ = size["speed"]
    tiny = dict(config, num_hidden_layers=2)
    _trainer(size, 4, SeqParallelStrategy(tp=1), [counter, SelectiveRecompute()]).fit(
        HFCausalLMModule(config=tiny), _tokens(config["vocab_size"], s, batch, 4))
    after_first = counter.per_step[1:]
    return Row("host syncs", "training step + backward, steps 2-4 (CUDA: sync debug mode 'error')",
               f"{after_first} device reads", "0 per step",
               all(c == 0 for c in after_first))


def offload_row(size: dict) -> Row:
    """The speed model at 4 layers, trained 3 steps without and with every module offloaded: the losses agree, the
    forward's peak falls, no host sync in the offloaded steps after the first; the bytes moved are reported."""
    import torch

    from lightning_seqpar import ActivationOffload, HostSyncCounter, SeqParallelStrategy
    from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES

    config, s, batch, _ = size["speed"]
    config, steps = dict(config, num_hidden_layers=4), 3
    runs = {}
    for name in ("none", "offload"):
        timer, phases = _Timer(warmup=0), _phase_peaks()
        callbacks = [timer.callback(), phases]
        if name == "offload":
            offload = ActivationOffload(modules=list(DENSE_OFFLOAD_MODULES))
            counter = HostSyncCounter(cuda_sync_debug="error" if size["device"] == "cuda" else None)
            callbacks += [offload, counter]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _trainer(size, steps, SeqParallelStrategy(tp=1), callbacks).fit(
            _speed_module(config), _tokens(config["vocab_size"], s, batch, steps))
        runs[name] = (timer.losses, phases.peaks.get("forward"))
    (plain, plain_peak), (losses, peak) = runs["none"], runs["offload"]
    error = max(abs(a / b - 1) for a, b in zip(losses, plain))
    syncs, moved = counter.per_step[1:], offload.pool.bytes_out / steps
    case = f"every module offloaded: Llama h={config['hidden_size']} L=4, {batch}x{s}, {steps} steps"
    tolerance = 1e-3 if size["device"] == "cuda" else 0.0  # CUDA's backward kernels may sum in another order
    pool = offload.pool  # the copies of layers 0-2 come back ahead of their backward (prefetch), layer 3's when read
    if peak is None or plain_peak is None:
        return Row("offload", case, f"loss {error:.1e} rel, {_gb(moved)} moved/step, {pool.prefetched}/"
                   f"{pool.copies_in} copies prefetched, {syncs} host syncs", "losses equal, 3/4 prefetched, 0 syncs",
                   error <= tolerance and all(c == 0 for c in syncs) and 4 * pool.prefetched == 3 * pool.copies_in)
    return Row("offload", case, f"forward peak {_gb(peak)} vs {_gb(plain_peak)}; loss {error:.1e} rel; {_gb(moved)} "
               f"moved/step; {pool.prefetched}/{pool.copies_in} copies prefetched; {syncs} host syncs",
               f"peak lower, loss ≤ {tolerance:g} rel, 3/4 prefetched, 0 syncs",
               peak < plain_peak and error <= tolerance and all(c == 0 for c in syncs)
               and 4 * pool.prefetched == 3 * pool.copies_in)


ROWS: dict[str, Callable[[dict], list[Row]]] = {
    "memory 0": lambda size: [memory_row(size, 0)],
    "memory 1": lambda size: [memory_row(size, 1)],
    "kernels": kernel_rows,
    "host syncs": lambda size: [host_sync_row(size)],
    "offload": lambda size: [offload_row(size)],
    "speed ours": lambda size: speed_rows(size, "ours"),
    "speed ours compiled": lambda size: speed_rows(size, "ours compiled"),
    "speed plain": lambda size: speed_rows(size, "plain"),
    "step times": step_time_rows,
}


def _row_process(name: str, cpu: bool, out: str, calibration: Optional[str]) -> None:
    """In a row's process: ``ROWS[name]``, its rows written to ``out`` as JSON (a failure's traceback beside it)."""
    # Each row is a job of its own: a rendezvous inherited from the caller (a port its own process group holds) is
    # not the row's, and Lightning picks a free port when none is set.
    for key in RENDEZVOUS:
        os.environ.pop(key, None)
    try:
        rows = ROWS[name](_size(cpu, calibration))
    except BaseException:
        Path(out + ".err").write_text(traceback.format_exc())
        raise
    Path(out).write_text(json.dumps([asdict(row) for row in rows]))


def _run_row(name: str, cpu: bool, timeout: float, calibration: Optional[str] = None) -> list[Row]:
    """``ROWS[name]`` in a fresh process; a crash or timeout is a failed row with the error's last line.

    The process is forked from a server that imported torch, Lightning and transformers once (multiprocessing's
    forkserver with a preload): a new interpreter per row spent about 9 s of CPU on those imports. The server never
    touches CUDA, so each row initializes its own device and its peak memory is its own.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts (the first row)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rows.json")
        process = context.Process(target=_row_process, args=(name, cpu, out, calibration))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            return [Row(name, "-", f"timed out after {timeout:.0f} s", "-", False)]
        if process.exitcode != 0 or not Path(out).exists():
            error = Path(out + ".err")
            if error.exists():
                print(f"{name} failed:\n{error.read_text()}", file=sys.stderr, flush=True)  # the table keeps 1 line
            last = error.read_text().strip().splitlines()[-1] if error.exists() else f"exit code {process.exitcode}"
            return [Row(name, "-", f"failed: {last[:160]}", "-", False)]
        return [Row(**row) for row in json.loads(Path(out).read_text())]


def _loss_rows(rows: list[Row]) -> list[Row]:
    """Our first loss (vocabulary-parallel head, loss over chunks of positions, bf16-mixed) against plain Lightning's
    on the same weights and batch."""
    first = {row.case.split(":")[0]: float(row.expected.split()[-1]) for row in rows
             if row.check == "speed" and row.expected.startswith("first loss")}
    if "ours" not in first or "plain" not in first:
        return []
    out = []
    for library in ("ours", "ours compiled"):
        if library in first:
            error = abs(first[library] / first["plain"] - 1)
            out.append(Row("kernels", f"first loss, {library} vs plain (chunked vocabulary-parallel loss, bf16)",
                           f"{first[library]:.4f} ({error:.1e} rel)", f"{first['plain']:.4f} ± 5e-3 rel",
                           error <= 5e-3))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the dry parts on CPU, at a small size")
    parser.add_argument("--only", nargs="*", default=None, choices=list(ROWS), help="rows to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--calibration", type=Path, help="write the step-time row's device rates to this file "
                        "(a calibration the planner reads: one process, no collectives)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each row may run before it counts as failed (default: 300)")
    args = parser.parse_args(argv)
    from lightning_seqpar.extras import require_extra

    require_extra("hf", "recipes/gpu_check.py (Hugging Face Llamas)")  # said before any process starts
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("No CUDA device: run with --cpu for the dry parts.", file=sys.stderr)
            return 2
    calibration = None if args.calibration is None else str(args.calibration.resolve())
    rows = []
    for name in args.only or ROWS:
        for row in _run_row(name, args.cpu, timeout=args.timeout, calibration=calibration):
            rows.append(row)  # printed as it ends too: a run cut short still shows what it measured
            print(f"{row.check} | {row.case} | {row.measured} | {row.expected} | {row.ok}", flush=True)
    rows += _loss_rows(rows)
    _print(rows, args.cpu)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 1 if any(row.ok is False for row in rows) else 0


def _environment(cpu: bool) -> str:
    """The device and the library versions the figures were measured with (a table is only as good as its caption)."""
    import lightning
    import torch
    import transformers

    device = "CPU" if cpu else torch.cuda.get_device_name()
    return (f"{device}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"lightning {lightning.__version__}")


def _print(rows: list[Row], cpu: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning_seqpar GPU check" + (" (dry run on CPU)" if cpu else ""),
                  caption=_environment(cpu))
    for column in ("check", "case", "measured", "expected", "ok"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.check, row.case, row.measured, row.expected,
                      {True: "yes", False: "NO", None: "-"}[row.ok])
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
