"""``python -m lightning_seqpar.plan MODEL --gpus N --gpu-memory 80GB --seq-len S --global-batch B``: the layouts of
MODEL on N GPUs, ranked (see :mod:`lightning_seqpar.plan.planner`), over tensor, context (``--cp`` to restrict), pipeline and data
parallel sizes; ``--memory-choices``: layouts too large for the GPU tried again with the MLP recomputed and activations
offloaded to host memory.

``python -m lightning_seqpar.plan calibrate --out FILE`` measures this machine's GEMM, attention and collective rates
(:mod:`..measuring.calibrate`); ``--calibration FILE`` then prices the step time with them instead of nominal rates.

MODEL is a Hugging Face ``config.json``, a directory holding one, or a GPT size of the paper (``gpt-22b``, ``gpt-175b``,
``gpt-530b``, ``gpt-1t``). Prints the top feasible layouts with the most loaded rank's bytes by kind, the headroom left,
FLOPs, bytes per collective kind, the bubble and the predicted step time, then one line per rejection rule with its
count (``--verbose``: every rejected layout with its reason), and, when nothing fits, what would (the GPU memory the
smallest layout needs, a shorter sequence, the fused attention kernel, LoRA); ``--json`` prints every record instead; ``--dry-run`` builds each pipeline rank of the top layout at full size on the
meta device and prints its parameter bytes against the prediction.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning_seqpar.checkpoint.peft_adapter import LORA_TARGETS
from lightning_seqpar.pipeline_parallel.schedules import SEARCHED_SCHEDULES, splits_backward
from lightning_seqpar.plan.measuring.calibration import StepCalibration
from lightning_seqpar.plan.pricing.cost import Hardware
from lightning_seqpar.plan.measuring.fit_cache import FitCache, default_cache_directory
from lightning_seqpar.plan.pricing.memory_choices import describe
from lightning_seqpar.plan.measuring.models import load_model_config, model_inventory, with_attention
from lightning_seqpar.plan.planner import LayoutRecord, plan
from lightning_seqpar.plan.measuring.probe import PROBES_PER_FIT
from lightning_seqpar.plan.measuring.probe_pool import default_workers, probe_pool
from lightning_seqpar.sizes import parse_bytes

GB = 1e9
MAX_GPUS = 1 << 20
"""The largest GPU count planned (a million: beyond any cluster); more is refused rather than searched for hours."""


def _chunk(text: str) -> Optional[int]:
    """``--loss-chunk``: a positive number of positions, or ``none``."""
    if text.lower() == "none":
        return None
    return _count("--loss-chunk", 1 << 30)(text)


def _count(flag: str, most: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[1, most]``, else an error naming ``flag`` and the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{value:,} is outside 1..{most:,}")
        return value

    parse.__name__ = flag
    return parse


def _layout(r: LayoutRecord) -> str:
    lay = r.layout
    return (f"tp{lay.tp}{f' cp{lay.cp}' if lay.cp > 1 else ''} pp{lay.pp}"
            f"{f'×v{lay.virtual_stages}' if lay.virtual_stages > 1 else ''}"
            f"{f' {lay.schedule}' if lay.pp > 1 and splits_backward(lay.schedule) else ''} dp{r.dp}"
            f"{f' ep{lay.ep}' if lay.ep > 1 else ''}{f' etp{lay.expert_tp}' if lay.expert_tp > 1 else ''}"
            f"{' zero1' if lay.zero else ''} "
            f"mbs{r.micro_batch} {describe(r)}")


def _experts_cell(r: LayoutRecord) -> str:
    """The ep column: ``e``, or ``e×etp`` where each expert's width is split over etp ranks too."""
    return f"{r.layout.ep}×{r.layout.expert_tp}" if r.layout.expert_tp > 1 else str(r.layout.ep)


def _rule_of(reason: str) -> str:
    """A rejection's rule: its reason with the numbers taken out (``layers=N not divisible by pp·vpp=N``)."""
    return re.sub(r"\d+(\.\d+)?", "N", reason)


def table(records: list[LayoutRecord], hardware: Hardware, top: int, verbose: bool = False) -> str:
    """The top feasible layouts (the most loaded rank's GB by kind, what is left of the GPU, the predicted step, bubble
    and MFU), then the rejected layouts: one line per rule with its count and an example, and the layouts too large
    for the GPU in one line with the smallest; ``verbose``: every rejected layout with its reason."""
    feasible = [r for r in records if r.feasible][:top]
    # a mixture of experts: its expert-parallel size (× expert_tp where it splits the widths), a column of its own
    experts = any(r.layout.ep > 1 or r.layout.expert_tp > 1 for r in records)
    # several pipeline schedules searched: the one each layout was priced with, a column of its own
    schedules = len({r.layout.schedule.replace("interleaved_", "") for r in records
                     if r.layout.pp > 1 and r.feasible}) > 1
    chunks = len({r.layout.loss_chunk for r in records if r.feasible}) > 1  # several loss_chunk searched: a column
    head = (f"| rank | tp | cp | pp | vpp |{' schedule |' if schedules else ''} dp |{' ep |' if experts else ''} zero | "
            f"mbs | m | recompute |{' loss chunk |' if chunks else ''} params | grads | main | optim | act | other | "
            f"total GB | left GB | step s | bubble | MFU |")
    lines = [head, "|" + "---|" * (21 + experts + schedules + chunks)]
    for i, r in enumerate(feasible, 1):
        b, lay = r.bytes, r.layout
        mfu = r.flops["model"] / (r.step_time["total"] * lay.tp * lay.cp * lay.pp * r.dp) / hardware.peak_flops
        lines.append(f"| {i} | {lay.tp} | {lay.cp} | {lay.pp} | {lay.virtual_stages} |"
                     f"{f' {lay.schedule} |' if schedules else ''} {r.dp} |"
                     f"{f' {_experts_cell(r)} |' if experts else ''} {lay.zero} | "
                     f"{r.micro_batch} | {lay.num_microbatches} | "
                     f"{describe(r)} | " + (f"{lay.loss_chunk or 'whole'} | " if chunks else "")
                     + " | ".join(f"{b[k] / GB:.1f}" for k in (
                         "parameters", "gradients", "main_params", "optimizer", "activations", "other", "total"))
                     + f" | {(hardware.memory - b['total']) / GB:.1f} | {r.step_time['total']:.2f} | {r.bubble:.2f} | "
                     f"{mfu:.2f} |")
    traded = [f"- {i}: {r.why}" for i, r in enumerate(feasible, 1) if r.why]
    if traded:
        lines.append("\nTraded for memory (recomputation by module, activation offload):\n" + "\n".join(traded))
    if not feasible:
        lines.append("| (no layout fits) |")
    elif feasible[0].other:
        lines.append("\nRank 1's other: " + ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f} GB"
                                                     for k, v in feasible[0].other.items()))
    rules: dict[str, list[LayoutRecord]] = defaultdict(list)
    memory = sorted((r for r in records if not r.feasible and r.bytes), key=lambda r: r.bytes["total"])
    for r in records:
        if not r.feasible and not r.bytes:  # rejected by a rule before its bytes were priced
            rules[r.reason if verbose else _rule_of(r.reason or "")].append(r)
    lines.append(f"\nRejected: {sum(map(len, rules.values())) + len(memory)} layouts"
                 + ("" if verbose else " (every one with its reason: --verbose or --json)"))
    for rule, rejected in sorted(rules.items(), key=lambda item: -len(item[1])):
        if verbose:
            lines.append(f"- {rule}: {', '.join(_layout(r) for r in rejected)}")
        else:
            lines.append(f"- {len(rejected)} × {rule} (e.g. {_layout(rejected[0])}: {rejected[0].reason})")
    if verbose:
        lines += [f"- {_layout(r)}: {r.reason}" for r in memory]
    elif memory:
        lines.append(f"- {len(memory)} × too large for the GPU (the smallest: {_layout(memory[0])}: {memory[0].reason})")
    return "\n".join(lines)


TRADED_LAYOUTS = 3
"""the hint's memory choices are tried on this many of the smallest layouts too large for the GPU (each layout's
choices are probed apart: on every layout they took half of a first answer's time)"""


def what_would_fit(records: list[LayoutRecord], inventory: Any, args: argparse.Namespace, hardware: Hardware,
                   fits: Any = None) -> str:
    """When no layout fits: the GPU memory the smallest layout needs, then each change of the question that would
    fit, planned again (its best layout and bytes): more GPUs, ``bf16-true`` (float32 main params under zero 1),
    LoRA, recomputation by module and activation offload (``--memory-choices``), the fused attention kernel, a
    shorter sequence. A change that does not fit says what its smallest layout needs. ``fits``: the probes' cache
    the question used (each change probes only what it changes)."""
    memory = sorted((r for r in records if not r.feasible and r.bytes), key=lambda r: r.bytes["total"])
    if not memory:
        return "\nNo layout passes the rules above: change the GPU count, the batch or the sequence length they name."
    least = memory[0]
    lines = ["\nNo layout fits. What would:",
             f"- GPUs of at least {least.bytes['total'] / args.headroom / GB:.0f} GB (--gpu-memory; the smallest "
             f"layout, {_layout(least)}, needs {least.bytes['total'] / GB:.1f} GB at --headroom {args.headroom:g})"]
    fits = {} if fits is None else fits
    question = dict(gpus=args.gpus, seq_len=args.seq_len, precision=args.precision, lora=args.lora,
                    memory_choices=args.memory_choices, attention=args.attention)

    # (each a meta model built and rewritten: by its config, which a sequence length changes for a GPT size only)
    inventories = {(_config_text(args.model, args.seq_len), args.attention, args.lora): inventory}

    def answer(flag: str, **change: Any) -> tuple[bool, str]:
        asked = dict(question, **change)
        model = (_config_text(args.model, asked["seq_len"]), asked["attention"], asked["lora"])
        other = next((v for k, v in inventories.items() if k[0] == model[0] and k[2] == model[2]), None)
        if model not in inventories and other is not None:  # another kernel's: the same parameters
            inventories[model] = with_attention(other, load_model_config(args.model, asked["seq_len"]),
                                                asked["attention"])
        elif model not in inventories:
            inventories[model] = model_inventory(args.model, asked["seq_len"], asked["attention"], asked["lora"],
                                                 args.lora_targets, args.frozen, cache=_kept(fits),
                                                 lora_experts=args.lora_experts and asked["lora"] is not None)
        # (a layout whose model state alone is too large is not priced further: no probes for it)
        again = plan(inventories[model], asked["gpus"], asked["seq_len"],
                     args.global_batch, hardware=hardware, precision=asked["precision"], headroom=args.headroom,
                     calibrate=not args.analytic, optimizer=args.optimizer, context_parallel=args.cp,
                     cp_comm=args.cp_comm, schedule=tuple(args.schedule), loss_chunk=tuple(args.loss_chunk),
                     memory_choices=asked["memory_choices"], fits=fits, state_floor=True,
                     memory_choices_on=TRADED_LAYOUTS if "memory_choices" in change else None)
        best = next((r for r in again if r.feasible), None)
        if best is not None:
            return True, f"- {flag}: {_layout(best)} fits ({best.bytes['total'] / GB:.1f} GB)"
        smallest = min((r for r in again if r.bytes), key=lambda r: r.bytes["total"], default=None)
        floored = any(r.state_floor for r in again)
        if smallest is not None:
            return False, (f"- {flag}: does not fit either (the smallest{' whose model state fits' if floored else ''}"
                           f", {_layout(smallest)}, needs {smallest.bytes['total'] / GB:.1f} GB)")
        least = min((r for r in again if r.state_floor), key=lambda r: r.state_floor, default=None)
        return False, f"- {flag}: does not fit either" + (
            f" (no layout's model state fits: the least, {_layout(least)}, needs {least.state_floor / GB:.1f} GB)"
            if least else "")

    def first_that_fits(changes: list[tuple[str, dict[str, Any]]]) -> None:
        """The first of ``changes`` (each larger than the one before) that fits, else the last one's answer."""
        for flag, change in changes:
            fits_now, line = answer(flag, **change)
            if fits_now:
                break
        lines.append(line)

    # more GPUs: the model state divides over them (the batch must divide over the data-parallel ones)
    first_that_fits([(f"--gpus {args.gpus * more}", dict(gpus=args.gpus * more)) for more in (2, 4, 8)])
    if args.precision != "bf16-true":
        lines.append(answer("--precision bf16-true (16-bit parameters; float32 main params where zero 1 shards them)",
                            precision="bf16-true")[1])
    if args.lora is None and not args.frozen:
        lines.append(answer("--lora 16 (the base frozen: no gradients, main params or optimizer state for it)",
                            lora=16)[1])
    if not args.memory_choices:
        lines.append(answer(f"--memory-choices (the MLP recomputed, activations offloaded to host memory; tried on the "
                            f"{TRADED_LAYOUTS} smallest layouts)", memory_choices=True)[1])
    if args.attention == "eager":
        lines.append(answer("--attention sdpa (no s² probabilities kept)", attention="sdpa")[1])
    first_that_fits([(f"--seq-len {shorter}", dict(seq_len=shorter))
                     for shorter in (args.seq_len // 2, args.seq_len // 4, args.seq_len // 8) if shorter >= 1])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command with ``argv`` (default ``sys.argv[1:]``): print the table (or the JSON records), return 0.

    Raises:
        FileNotFoundError: MODEL is no config.json, directory holding one, or GPT size.
        ValueError: a GPU, size or precision it does not know, or a model no built-in layout recognizes.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:  # the subcommand measuring this machine's rates (:mod:`..measuring.calibrate`)
        from lightning_seqpar.plan.measuring.calibrate import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--gpus", type=_count("--gpus", MAX_GPUS), required=True)
    parser.add_argument("--seq-len", type=_count("--seq-len", 1 << 24), required=True)
    parser.add_argument("--global-batch", type=_count("--global-batch", 1 << 24), required=True,
                        help="sequences per optimizer step")
    parser.add_argument("--gpu", default=None, help="h100 (default), h200, a100, b200: the rates' defaults")
    parser.add_argument("--gpu-memory", default=None, help="bytes per GPU, e.g. 80GB (default: the GPU's)")
    parser.add_argument("--gpus-per-node", type=_count("--gpus-per-node", MAX_GPUS), default=8)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-true", "32-true"])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"],
                        help="the attention kernel the run uses (HFCausalLMModule's attn_implementation)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "muon"],
                        help="its state per parameter element (sgd: with momentum; muon: optim.name=muon, momentum on "
                             "the layers' matrices and AdamW on the rest, zero=0)")
    parser.add_argument("--cp", type=_count("--cp", MAX_GPUS), nargs="+", default=None,
                        help="the context-parallel sizes to consider (default: every divisor of --gpus)")
    parser.add_argument("--cp-comm", default="ring", choices=["ring", "all_to_all"],
                        help="the context-parallel attention's communication")
    parser.add_argument("--schedule", nargs="+", default=list(SEARCHED_SCHEDULES), choices=list(SEARCHED_SCHEDULES),
                        help="the pipeline schedules searched for layouts with pp > 1 (default: all four; 1F1B: "
                             "interleaved where vpp > 1; ZB-H1: the backward split into B and W, vpp 1; ZB-V: split, "
                             "two chunks per rank in a V, vpp 2; DualPipeV: ZB-V's V in forward-backward pairs, "
                             "m >= 2·pp)")
    parser.add_argument("--lora", type=_count("--lora", 1 << 16), default=None, metavar="R",
                        help="LoRA of rank R (PEFT's, the base frozen: no gradients, main params or optimizer state "
                             "for it); default: full fine-tuning")
    parser.add_argument("--lora-targets", nargs="+", default=list(LORA_TARGETS),
                        help=f"the modules LoRA adapts (default: {' '.join(LORA_TARGETS)})")
    parser.add_argument("--lora-experts", action="store_true",
                        help="with --lora: adapters on a mixture's packed experts too (PEFT's target_parameters "
                             "mlp.experts.gate_up_proj and mlp.experts.down_proj), split with their experts")
    parser.add_argument("--frozen", nargs="+", default=(), metavar="NAME",
                        help="full fine-tuning with the parameters whose names contain NAME frozen (embed_tokens, "
                             "lm_head, router, ...)")
    parser.add_argument("--loss-chunk", type=_chunk, nargs="+", default=[4096], metavar="N|none",
                        help="the strategy's loss_chunk: positions of the loss's logits computed at a time, past which "
                             "a rank keeps none of them for backward (default 4096, the strategy's; none: whole); "
                             "several to search them (4096 none: the chunked loss's memory against the head's GEMM "
                             "made again)")
    parser.add_argument("--headroom", type=float, default=0.8)
    parser.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached")
    parser.add_argument("--calibration", default=None,
                        help="a file `python -m lightning_seqpar.plan calibrate --out FILE` wrote: the step time from "
                             "the rates measured there (else a rough estimate from --efficiency and nominal links)")
    parser.add_argument("--top", type=_count("--top", 1 << 20), default=10)
    parser.add_argument("--json", action="store_true", help="every layout considered, as JSON records")
    parser.add_argument("--verbose", action="store_true", help="every rejected layout with its reason")
    parser.add_argument("--dry-run", action="store_true",
                        help="build each pipeline rank of the top layout at full size on the meta device and print its "
                             "parameter bytes against the prediction")
    parser.add_argument("--memory-choices", action="store_true",
                        help="try a layout too large for the GPU again with the MLP recomputed and activations "
                             "offloaded to host memory (more probes: slower)")
    parser.add_argument("--analytic", action="store_true",
                        help="activations from Table 2's model instead of probes of the model's layer (faster)")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help=f"where the probes' fits are kept between questions (default: {default_cache_directory()}"
                             f"; a changed model, library or version probes again)")
    parser.add_argument("--no-cache", action="store_true", help="probe again, keeping nothing on disk")
    parser.add_argument("--probe-workers", type=_count("--probe-workers", 1 << 10), default=None, metavar="N",
                        help=f"processes measuring the probes at once (default: this machine's cores, at most "
                             f"{PROBES_PER_FIT}: {default_workers(PROBES_PER_FIT)}; 1: in this process)")
    started = time.perf_counter()
    args = parser.parse_args(argv)
    args.cp = tuple(args.cp) if args.cp else None
    if not 0 < args.headroom <= 1 or not 0 < args.efficiency <= 1:
        parser.error(f"--headroom {args.headroom:g} and --efficiency {args.efficiency:g} are fractions in (0, 1].")
    try:
        memory = float(parse_bytes(args.gpu_memory, "--gpu-memory")) if args.gpu_memory else None
    except ValueError as error:
        parser.error(str(error))
    try:
        calibration = StepCalibration.load(args.calibration) if args.calibration else None
    except ValueError as error:
        parser.error(str(error))
    hardware = Hardware.named(args.gpu or "h100", memory=memory, gpus_per_node=args.gpus_per_node,
                              efficiency=args.efficiency, calibration=calibration)
    gpu = args.gpu or ("h100" if memory is None else "GPU (h100's rates: --gpu to set them)")
    fits: Any = {} if args.no_cache else FitCache(Path(args.cache) if args.cache else default_cache_directory())
    try:
        inventory = model_inventory(args.model, args.seq_len, args.attention, args.lora, args.lora_targets,
                                    args.frozen, cache=_kept(fits), lora_experts=args.lora_experts)
    except ValueError as error:  # a target or frozen name that matches nothing: the user's argument, named
        if args.lora is None and not args.frozen and not args.lora_experts:
            raise
        parser.error(str(error))
    # (the workers start at the first probe: none for a question the cache answers)
    with probe_pool(fits, args.probe_workers, PROBES_PER_FIT):
        if _answer(args, inventory, hardware, gpu, calibration, fits):
            print(f"\nAnswered in {time.perf_counter() - started:.1f} s{_cache_line(fits)}.")
    return 0


def _answer(args: argparse.Namespace, inventory: Any, hardware: Hardware, gpu: str,
            calibration: Optional[StepCalibration], fits: Any) -> bool:
    """Plan the question of ``args`` and print the answer: the table, what would fit when nothing does, the dry run
    (``True``); or the JSON records alone (``False``)."""
    records = plan(inventory, args.gpus, args.seq_len, args.global_batch, hardware=hardware,
                   precision=args.precision, headroom=args.headroom, calibrate=not args.analytic,
                   optimizer=args.optimizer, context_parallel=tuple(args.cp) if args.cp else None,
                   cp_comm=args.cp_comm, memory_choices=args.memory_choices, schedule=tuple(args.schedule),
                   loss_chunk=tuple(args.loss_chunk), fits=fits)
    if args.json:
        json.dump([r.as_dict() for r in records], sys.stdout, indent=1)
        print()
        return False
    timing = (f"compute and collectives at the rates measured in {args.calibration} ({calibration.describe()})"
              if calibration else f"a rough estimate (compute at {args.efficiency:g} of peak, collectives at nominal "
                                  f"link rates; measure them: `python -m lightning_seqpar.plan calibrate --out FILE`, "
                                  f"then --calibration FILE)")
    trainable = inventory.num_trainable
    print(f"{inventory.name}: {inventory.num_parameters / 1e9:.2f} B parameters"
          f"{f' ({trainable / 1e6:,.1f} M trainable)' if trainable < inventory.num_parameters else ''}, "
          f"L={inventory.num_layers}, "
          f"h={inventory.hidden_size}, a={inventory.num_heads}, kv heads={inventory.num_kv_heads}, v={inventory.vocab_size}; "
          f"{args.gpus} × {gpu} ({hardware.memory / GB:g} GB, {args.headroom:g} usable), s={args.seq_len}, "
          f"global batch {args.global_batch} sequences, {args.precision}, {args.optimizer}, {args.attention} attention. Model-state bytes exact; a layer's "
          f"activations {'from Table 2' if args.analytic else 'measured on small copies of it and scaled'}, times "
          f"the micro-batches in flight; step time: {timing} + bubble ({' or '.join(args.schedule)} where pp > 1), nothing "
          f"overlapped.")
    print(table(records, hardware, args.top, args.verbose))
    best = next((r for r in records if r.feasible), None)
    if best is None:
        print(what_would_fit(records, inventory, args, hardware, fits))
    if args.dry_run and best is not None:
        from lightning_seqpar.plan.measuring.dry_run import dry_run

        lay = best.layout
        print(f"\nDry run of rank 1's layout (tp {lay.tp}, pp {lay.pp}, vpp {lay.virtual_stages}"
              f"{f', {lay.schedule}' if lay.pp > 1 else ''}"
              f"{f', ep {lay.ep}' if lay.ep > 1 else ''}"
              f"{f', expert_tp {lay.expert_tp}' if lay.expert_tp > 1 else ''}), "
              f"built on the meta device:")
        for rank in range(lay.pp):
            built = dry_run(load_model_config(args.model, args.seq_len), inventory, lay, rank, args.precision)
            print(f"  pipeline rank {rank}: parameters {built.measured:,} bytes built, {built.predicted:,} predicted"
                  f"{'' if built.measured == built.predicted else '  DIFFERENT'}")
    return True


def _config_text(model: str, seq_len: int) -> str:
    """The config ``model`` is planned with at ``seq_len`` (:func:`~..measuring.models.load_model_config`), as text to
    key by."""
    return json.dumps(load_model_config(model, seq_len), sort_keys=True, default=str)


def _kept(fits: Any) -> Optional[FitCache]:
    """The on-disk cache among the probes' ``fits`` (``None`` under ``--no-cache``): where inventories are kept too."""
    return fits if isinstance(fits, FitCache) else None


def _cache_line(fits: Any) -> str:
    """How the answer used the probes' cache (nothing without one, or with ``--analytic``)."""
    if not isinstance(fits, FitCache) or not fits.read + fits.written + fits.inventories_read:
        return ""
    models = (f"; {fits.inventories_read} of {fits.inventories_read + fits.inventories_written} model inventories "
              f"read from it" if fits.inventories_read + fits.inventories_written else "")
    return f" ({fits.read} probe fits read from {fits.directory}, {fits.written} probed and kept there{models})"


if __name__ == "__main__":
    raise SystemExit(main())
