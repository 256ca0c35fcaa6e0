"""``python -m lightning_seqpar.checkpoint consolidate CKPT_DIR OUT``: a sharded checkpoint as one
single-device state dict file, loadable with ``model.load_state_dict(...)`` without any process group:
``.safetensors`` is written one tensor at a time (memory: the largest tensor); ``.pt`` holds the whole model
in memory once (``torch.save``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_seqpar.checkpoint.consolidate import consolidate, consolidate_to_safetensors, write_state_dict


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0, or 2 when the checkpoint is not a complete sharded one)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="sharded checkpoint directory -> single-device state dict file")
    merge.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    merge.add_argument("out", help="output file: NAME.pt or NAME.safetensors")
    args = parser.parse_args(argv)
    try:
        if args.out.endswith(".safetensors"):
            count, total = consolidate_to_safetensors(args.checkpoint, args.out)
        else:
            state = consolidate(args.checkpoint)
            write_state_dict(state, args.out)
            count, total = len(state), sum(t.numel() * t.element_size() for t in state.values())
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {count} tensors ({total / 2**20:.1f} MiB) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
