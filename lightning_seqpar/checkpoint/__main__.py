"""``python -m lightning_seqpar.checkpoint verify CKPT_DIR``: every file checked against the checkpoint's manifest.

``python -m lightning_seqpar.checkpoint consolidate CKPT_DIR OUT``: a sharded checkpoint as one
single-device state dict file, loadable with ``model.load_state_dict(...)`` without any process group:
``.safetensors`` is written one tensor at a time (memory: the largest tensor); ``.pt`` holds the whole model
in memory once (``torch.save``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from lightning_seqpar.checkpoint.consolidate import consolidate, consolidate_to_safetensors, write_state_dict
from lightning_seqpar.checkpoint.manifest import check_files, read_manifest, unlisted_files
from lightning_seqpar.checkpoint.sharded import is_sharded_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0, or 2 when the checkpoint is not a complete sharded one)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="sharded checkpoint directory -> single-device state dict file")
    merge.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    merge.add_argument("out", help="output file: NAME.pt or NAME.safetensors")
    check = commands.add_parser("verify", help="check every file of a sharded checkpoint against its manifest")
    check.add_argument("checkpoint", help="a sharded checkpoint directory")
    args = parser.parse_args(argv)
    if args.command == "verify":
        return verify(Path(args.checkpoint))
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



def verify(path: Path) -> int:
    """Print each file of the checkpoint ``path`` with ``ok`` or what differs from its manifest; 0 when all match,
    1 when any differs (or the manifest is damaged), 2 when ``path`` is not a complete sharded checkpoint."""
    if not is_sharded_checkpoint(path):
        print(f"error: {path} is not a complete sharded checkpoint directory (no .metadata inside).", file=sys.stderr)
        return 2
    try:
        manifest = read_manifest(path)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if manifest is None:
        print(f"{path}: no manifest (written before they existed); nothing to check against.")
        return 1
    bad = 0
    for name in sorted(manifest["files"]):
        problems = check_files(path, manifest, [name])
        print(f"{name}: {'ok' if not problems else problems[0].split(': ', 1)[1]}")
        bad += bool(problems)
    for line in unlisted_files(path, manifest):
        print(line)
        bad += 1
    print(f"{path}: {'all files are as written' if not bad else f'{bad} file(s) differ from what was written'} "
          f"(save {manifest['save_id']}).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())