"""Naming what failed when a peer rank stalls or dies: the collective and where it was called."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Optional

from lightning_seqpar.parallel.collectives import ASYNC_COLLECTIVE, ASYNC_GROUP

_TORCH_DISTRIBUTED = ("torch/distributed/distributed_c10d.py",)
# gloo words it "Timed out waiting 8000ms for recv operation" or "Application timeout caused pair closure".
_TIMEOUT_WORDS = ("timed out", "timeout")


@dataclass(frozen=True)
class CollectiveFailure:
    """A ``torch.distributed`` collective that raised."""

    collective: str
    """e.g. ``"torch.distributed.all_reduce (called at tensor_parallel/collectives.py:105 in all_reduce) on process
    group 'mesh_tensor'"`` (the group's description, where the traceback holds it)"""
    timed_out: bool
    """whether it gave up waiting for a peer (the process-group timeout), rather than losing it"""


def failed_collective(exception: BaseException) -> Optional[CollectiveFailure]:
    """The collective ``exception`` was raised in, or ``None`` if it was not raised in one.

    The collective is the innermost ``torch.distributed`` function on the traceback; the call site is the
    innermost frame outside ``torch``. NCCL reports timeouts through its watchdog, which aborts the
    process instead of raising (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), so this sees gloo's.
    """
    frames = traceback.extract_tb(exception.__traceback__)
    name = next((f.name for f in reversed(frames) if f.filename.endswith(_TORCH_DISTRIBUTED)), None)
    if name is None:  # a collective started asynchronously fails where it is waited for (Pending.wait)
        name = getattr(exception, ASYNC_COLLECTIVE, None)
    if name is None:
        return None
    site = next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
    where = ""
    if site is not None:
        short = "/".join(site.filename.rsplit("/", 2)[-2:])
        where = f" (called at {short}:{site.lineno} in {site.name})"
    group = _group_description(exception)
    on = f" on process group {group!r}" if group else ""
    text = str(exception).lower()
    return CollectiveFailure(f"torch.distributed.{name}{where}{on}", any(word in text for word in _TIMEOUT_WORDS))


def _group_description(exception: BaseException) -> Optional[str]:
    """The ``group_desc`` of the process group the innermost ``torch.distributed`` frame was called with (the default
    group's is ``"default_pg"``; the library names its own: ``mesh_tensor``, ``async_save``, ...)."""
    found, tb = getattr(exception, ASYNC_GROUP, None), exception.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(_TORCH_DISTRIBUTED) and "group" in frame.f_locals:
            group = frame.f_locals["group"]
            found = "default_pg" if group is None else getattr(group, "group_desc", None) or found
        tb = tb.tb_next
    return found
