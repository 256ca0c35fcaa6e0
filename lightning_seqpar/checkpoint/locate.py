"""What a path given as a checkpoint is, when it is not one: said so, with what it holds and the fix."""

from __future__ import annotations

from pathlib import Path

from lightning_seqpar.checkpoint.sharded import is_sharded_checkpoint

_LISTED = 8


def checkpoints_in(directory: Path) -> list[str]:
    """Names of the checkpoints directly inside ``directory`` (sharded checkpoint directories and ``.ckpt`` files),
    sorted."""
    return sorted(p.name for p in directory.iterdir()
                  if is_sharded_checkpoint(p) or (p.is_file() and p.suffix == ".ckpt"))


def not_a_checkpoint(path: Path) -> str:
    """Why the directory ``path`` (which has no ``.metadata``) cannot be resumed from, and what to pass instead: a
    folder of checkpoints lists them; a Hugging Face model directory says how to start from its weights; anything
    else is an unfinished or damaged save."""
    path = Path(path)
    found = checkpoints_in(path)
    if found:
        shown = ", ".join(found[:_LISTED]) + (f" and {len(found) - _LISTED} more" if len(found) > _LISTED else "")
        pick = "last.ckpt" if "last.ckpt" in found else found[-1]
        return (f"{path} is a folder of checkpoints, not a checkpoint: it holds {shown}. Resume from one of them, e.g. "
                f"ckpt_path={path / pick}.")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (f"{path} is a Hugging Face model directory, not a training checkpoint. To start training from its "
                f"weights, pass it as the model (model=hf_pretrained model.pretrained={path}), without ckpt_path.")
    return (f"{path} is a directory without .metadata: a sharded checkpoint whose save did not finish, or a damaged "
            f"one. Resume from the checkpoint before it.")
