"""``python -m lightning_seqpar.checkpoint verify CKPT_DIR``: every file checked against the checkpoint's manifest.

``python -m lightning_seqpar.checkpoint consolidate CKPT_DIR OUT [--prefix P]``: a sharded checkpoint as one
single-device state dict file, keyed as your LightningModule's ``state_dict`` (``module.load_state_dict(...)``
takes it, without any process group); ``--prefix model.`` keeps the keys under ``model.`` without it, for the
model your module holds as ``self.model``. ``.safetensors`` is written one tensor at a time (memory: the largest
tensor); ``.pt``/``.pth`` hold the whole model in memory once (``torch.save``).

``python -m lightning_seqpar.checkpoint export-hf CKPT_DIR OUT_DIR [--config MODEL_DIR]``: the Hugging Face model
in a sharded checkpoint as a directory ``from_pretrained`` loads (one tensor in memory at a time); for a LoRA
checkpoint, the PEFT adapter directory ``PeftModel.from_pretrained(base, OUT_DIR)`` loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from lightning_seqpar.checkpoint.consolidate import consolidate, consolidate_to_safetensors, write_state_dict
from lightning_seqpar.checkpoint.manifest import check_files, read_manifest, unlisted_files
from lightning_seqpar.checkpoint.destination import refuse_existing_file
from lightning_seqpar.checkpoint.locate import not_a_checkpoint
from lightning_seqpar.checkpoint.sharded import is_sharded_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0, or 2 when the checkpoint is not a complete sharded one)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_seqpar.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="sharded checkpoint directory -> single-device state dict file")
    merge.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    merge.add_argument("out", help="output file: NAME.safetensors, NAME.pt or NAME.pth")
    merge.add_argument("--prefix", default="", help="keep only the keys under this prefix, without it (e.g. model.)")
    export = commands.add_parser("export-hf", help="sharded checkpoint -> Hugging Face model directory")
    export.add_argument("checkpoint", help="a sharded checkpoint directory of a Hugging Face model")
    export.add_argument("out", help="the directory to write")
    export.add_argument("--config", default=None,
                        help="the model directory it was trained from (config, tokenizer and generation files); "
                             "default: the config the checkpoint records")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    export.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="dtype written (default: as trained)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace a previous export at OUT (never anything else)")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing file at OUT")
    for command in (merge, export):
        command.add_argument("--allow-unverified", action="store_true",
                             help="read a checkpoint whose manifest is gone, its files unchecked")
    check = commands.add_parser("verify", help="check every file of a sharded checkpoint against its manifest")
    check.add_argument("checkpoint", help="a sharded checkpoint directory")
    args = parser.parse_args(argv)
    if args.command == "verify":
        return verify(Path(args.checkpoint))
    try:
        if args.command == "export-hf":
            from lightning_seqpar.checkpoint.hf_from_checkpoint import export_checkpoint_to_hf

            dtype = None if args.dtype is None else getattr(torch, args.dtype)
            out = export_checkpoint_to_hf(args.checkpoint, args.out, args.config, max_shard_size=args.max_shard_size,
                                          dtype=dtype, overwrite=args.overwrite,
                                          allow_unverified=args.allow_unverified)
            print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
            return 0
        suffix = Path(args.out).suffix
        if suffix not in (".safetensors", ".pt", ".pth"):
            raise ValueError(f"{args.out}: name the output file NAME.safetensors, NAME.pt or NAME.pth (the format "
                             f"comes from the suffix); for a Hugging Face directory use export-hf.")
        refuse_existing_file(args.out, args.overwrite)
        if suffix == ".safetensors":
            count, total = consolidate_to_safetensors(args.checkpoint, args.out, prefix=args.prefix,
                                                      allow_unverified=args.allow_unverified)
        else:
            state = consolidate(args.checkpoint, prefix=args.prefix, allow_unverified=args.allow_unverified)
            write_state_dict(state, args.out)
            count, total = len(state), sum(t.numel() * t.element_size() for t in state.values())
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {count} tensors ({total / 2**20:.1f} MiB) to {args.out}")
    return 0



def verify(path: Path) -> int:
    """Print each file of the checkpoint ``path`` with ``ok`` or what differs from its manifest; 0 when all match,
    1 when any differs (or the manifest is damaged), 2 when ``path`` is not a complete sharded checkpoint."""
    if not is_sharded_checkpoint(path):
        print(f"error: {not_a_checkpoint(path) if Path(path).is_dir() else f'{path} is not a complete sharded checkpoint directory (no .metadata inside).'}", file=sys.stderr)
        return 2
    try:
        manifest = read_manifest(path)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if manifest is None:
        from lightning_seqpar.checkpoint.trainer_checkpoint import recorded_save_id

        save_id = recorded_save_id(path)
        print(f"{path}: no manifest ({f'it is gone: trainer_state.pt names save {save_id}' if save_id else 'written before they existed'}); nothing to check against.")
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