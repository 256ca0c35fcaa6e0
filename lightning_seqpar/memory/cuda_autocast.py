"""CUDA autocast's float32 rule for norms and softmax, applied to CPU autocast.

CUDA autocast runs ``layer_norm`` and ``softmax`` (without an explicit ``dtype``) in float32 whatever their
input (the "CUDA ops that can autocast to float32" of torch's autocast op reference); CPU autocast leaves a
16-bit input in 16 bits. Bytes kept for backward under ``bf16-mixed`` are measured on CPU with this rule in
force (the planner's probes, :mod:`lightning_seqpar.plan.measuring.probe`, and the memory tests), so they are what a GPU
keeps. The rule is registered as AutocastCPU kernels of ``aten::layer_norm`` and ``aten::softmax.int`` for the duration
of the ``with`` block (process-wide: every thread, the emulated ranks included).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from lightning_seqpar._compat import destroy_library


def _upcast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.float() if t is not None and t.dtype in (torch.bfloat16, torch.float16) else t


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    with torch.autocast("cpu", enabled=False):
        return torch.ops.aten.layer_norm(_upcast(input), normalized_shape, _upcast(weight), _upcast(bias), eps,
                                         cudnn_enable)


def _softmax(input, dim, dtype=None):
    with torch.autocast("cpu", enabled=False):
        return torch.ops.aten.softmax(input if dtype is not None else _upcast(input), dim, dtype)


@contextmanager
def cuda_autocast_rules() -> Iterator[None]:
    """While open, CPU autocast runs ``layer_norm`` and ``softmax`` in float32 as CUDA autocast does."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("layer_norm", _layer_norm, "AutocastCPU")
    library.impl("softmax.int", _softmax, "AutocastCPU")
    try:
        yield
    finally:
        destroy_library(library)
