"""Dicts that pipeline stages hold each a part of, merged: used by both checkpoint formats (the full format's state
dict, the sharded format's record of shapes and tied keys)."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from lightning_seqpar.parallel.collectives import ParallelGroup


def merge_over_stages(local: dict[str, Any], pipeline: Optional[ParallelGroup]) -> dict[str, Any]:
    """Union of every pipeline stage's ``local`` dict (collective over ``pipeline``; identity without one).

    Each stage holds its own layers and a copy of the shared modules, so the union is the whole
    model's dict; shared entries are identical on every stage and the first stage's copy is kept.
    """
    if pipeline is None or pipeline.size == 1:
        return local
    parts: list[Any] = [None] * pipeline.size
    dist.all_gather_object(parts, local, group=pipeline.group)
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged
