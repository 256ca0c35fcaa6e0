"""``python -m lightning_seqpar.plan MODEL --gpus N --gpu-memory 80GB --seq-len S --global-batch B``: the layouts of
MODEL on N GPUs, ranked (see :mod:`lightning_seqpar.plan.planner`).

MODEL is a Hugging Face ``config.json``, a directory holding one, or a GPT size of the paper (``gpt-22b``, ``gpt-175b``,
``gpt-530b``, ``gpt-1t``). Prints the top feasible layouts with the most loaded rank's bytes by kind, the headroom left,
FLOPs, bytes per collective kind, the bubble and the predicted step time, then every rejected layout with its reason;
``--json`` prints every record instead; ``--dry-run`` builds each pipeline rank of the top layout at full size on the
meta device and prints its parameter bytes against the prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Optional, Sequence

from lightning_seqpar.checkpoint.hf_export import parse_size
from lightning_seqpar.plan.cost import Hardware
from lightning_seqpar.plan.models import load_model_config, model_inventory
from lightning_seqpar.plan.planner import LayoutRecord, plan

GB = 1e9


def _layout(r: LayoutRecord) -> str:
    return (f"tp{r.tp} pp{r.pp}{f'×v{r.vpp}' if r.vpp > 1 else ''} dp{r.dp}{' zero1' if r.zero else ''} "
            f"mbs{r.micro_batch} {r.recompute}")


def table(records: list[LayoutRecord], hardware: Hardware, top: int) -> str:
    """The top feasible layouts (the most loaded rank's GB by kind, what is left of the GPU, the predicted step, bubble
    and MFU), then every rejected layout with its reason, as text."""
    feasible = [r for r in records if r.feasible][:top]
    head = ("| rank | tp | pp | vpp | dp | zero | mbs | m | recompute | params | grads | main | optim | act | other | "
            "total GB | left GB | step s | bubble | MFU |")
    lines = [head, "|" + "---|" * 20]
    for i, r in enumerate(feasible, 1):
        b = r.bytes
        mfu = r.flops["model"] / (r.step_time["total"] * r.tp * r.pp * r.dp) / hardware.peak_flops
        lines.append(f"| {i} | {r.tp} | {r.pp} | {r.vpp} | {r.dp} | {r.zero} | {r.micro_batch} | {r.num_microbatches} | "
                     f"{r.recompute} | " + " | ".join(f"{b[k] / GB:.1f}" for k in (
                         "parameters", "gradients", "main_params", "optimizer", "activations", "other", "total"))
                     + f" | {(hardware.memory - b['total']) / GB:.1f} | {r.step_time['total']:.2f} | {r.bubble:.2f} | "
                     f"{mfu:.2f} |")
    if not feasible:
        lines.append("| (no layout fits) |")
    elif feasible[0].other:
        lines.append("\nRank 1's other: " + ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f} GB"
                                                     for k, v in feasible[0].other.items()))
    rules: dict[str, list[str]] = defaultdict(list)
    memory = []
    for r in records:
        if r.feasible:
            continue
        if r.bytes:  # passed the rules, too large
            memory.append((r.bytes["total"], f"- {_layout(r)}: {r.reason}"))
        else:
            rules[r.reason or ""].append(_layout(r))
    lines.append(f"\nRejected: {sum(map(len, rules.values())) + len(memory)} layouts")
    for reason, layouts in sorted(rules.items(), key=lambda item: -len(item[1])):
        lines.append(f"- {reason}: {', '.join(layouts)}")
    lines += [line for _, line in sorted(memory)]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command with ``argv`` (default ``sys.argv[1:]``): print the table (or the JSON records), return 0.

    Raises:
        FileNotFoundError: MODEL is no config.json, directory holding one, or GPT size.
        ValueError: a GPU, size or precision it does not know, or a model no built-in layout recognizes.
    """
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--gpu", default="h100", help="h100, h200, a100, b200: the rates' defaults")
    parser.add_argument("--gpu-memory", default=None, help="bytes per GPU, e.g. 80GB (default: the GPU's)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-true", "32-true"])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"],
                        help="the attention kernel the run uses (HFCausalLMModule's attn_implementation)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"],
                        help="its state per parameter element (sgd: with momentum)")
    parser.add_argument("--headroom", type=float, default=0.8)
    parser.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="every layout considered, as JSON records")
    parser.add_argument("--dry-run", action="store_true",
                        help="build each pipeline rank of the top layout at full size on the meta device and print its "
                             "parameter bytes against the prediction")
    parser.add_argument("--analytic", action="store_true",
                        help="activations from Table 2's model instead of probes of the model's layer (faster)")
    args = parser.parse_args(argv)
    memory = float(parse_size(args.gpu_memory)) if args.gpu_memory else None
    hardware = Hardware.named(args.gpu, memory=memory, gpus_per_node=args.gpus_per_node, efficiency=args.efficiency)
    inventory = model_inventory(args.model, args.seq_len, args.attention)
    records = plan(inventory, args.gpus, args.seq_len, args.global_batch, hardware=hardware,
                   precision=args.precision, headroom=args.headroom, calibrate=not args.analytic,
                   optimizer=args.optimizer)
    if args.json:
        json.dump([r.as_dict() for r in records], sys.stdout, indent=1)
        print()
        return 0
    print(f"{inventory.name}: {inventory.num_parameters / 1e9:.2f} B parameters, L={inventory.num_layers}, "
          f"h={inventory.hidden_size}, a={inventory.num_heads}, kv heads={inventory.num_kv_heads}, v={inventory.vocab_size}; "
          f"{args.gpus} × {args.gpu} ({hardware.memory / GB:g} GB, {args.headroom:g} usable), s={args.seq_len}, "
          f"global batch {args.global_batch} sequences, {args.precision}, {args.optimizer}, {args.attention} attention. Model-state bytes exact; a layer's "
          f"activations {'from Table 2' if args.analytic else 'measured on small copies of it and scaled'}, times "
          f"the micro-batches in flight; step time: compute at {args.efficiency:g} of peak + collectives + bubble, "
          f"nothing overlapped.")
    print(table(records, hardware, args.top))
    best = next((r for r in records if r.feasible), None)
    if args.dry_run and best is not None:
        from lightning_seqpar.plan.dry_run import dry_run

        print(f"\nDry run of rank 1's layout (tp {best.tp}, pp {best.pp}, vpp {best.vpp}), built on the meta device:")
        for rank in range(best.pp):
            built = dry_run(load_model_config(args.model, args.seq_len), inventory, best.tp, best.pp, best.vpp, rank,
                            args.precision)
            print(f"  pipeline rank {rank}: parameters {built.measured:,} bytes built, {built.predicted:,} predicted"
                  f"{'' if built.measured == built.predicted else '  DIFFERENT'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
