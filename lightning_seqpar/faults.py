"""Naming what failed when a peer rank stalls: the collective that timed out and where it was called."""

from __future__ import annotations

import traceback
from typing import Optional

_TORCH_DISTRIBUTED = ("torch/distributed/distributed_c10d.py",)


def timed_out_collective(exception: BaseException) -> Optional[str]:
    """``"torch.distributed.all_reduce (called at strategy.py:372 in reduce)"`` when ``exception`` is a
    collective's timeout (gloo: "Timed out waiting ... for recv operation"), else ``None``.

    The collective is the innermost ``torch.distributed`` function on the traceback; the call site is the
    innermost frame outside ``torch``. NCCL reports timeouts through its watchdog, which aborts the
    process instead of raising (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), so this sees gloo's.
    """
    if "timed out" not in str(exception).lower():
        return None
    frames = traceback.extract_tb(exception.__traceback__)
    collective = next((f.name for f in reversed(frames) if f.filename.endswith(_TORCH_DISTRIBUTED)), None)
    if collective is None:
        return None
    site = next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
    where = f" (called at {site.filename.rsplit('/', 2)[-2]}/{site.filename.rsplit('/', 1)[-1]}:{site.lineno} in {site.name})" if site else ""
    return f"torch.distributed.{collective}{where}"
