"""Operations that CUDA autocast runs in float32 keep their 16-bit input for backward, not the float32 copy.

CUDA autocast casts the input of ``layer_norm``, ``softmax`` and the other operations on its float32 list to
float32 before running them, and the operation keeps what it ran on (a norm its input, a softmax its output):
4 bytes per element where Table 2 of Korthikanti et al. (2022) counts 2. Megatron-LM avoids this with fused
kernels that compute in float32 but keep 16-bit tensors. Here such an operation runs in
``torch.utils.checkpoint``: only its 16-bit input is kept, and the upcast and the operation are recomputed in
backward under the same autocast state, so the numbers are autocast's. These operations are memory-bound: the
recomputation reads about what reading the kept float32 tensor would have.

CPU autocast does not upcast ``layer_norm`` or ``softmax``; the tests apply CUDA's rule on CPU
(``lightning_seqpar/memory/cuda_autocast.py``) to measure what a GPU keeps.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def keeping_16_bit_input(function: Callable[..., Any], x: Tensor, *args: Any, **kwargs: Any) -> Any:
    """``function(x, *args, **kwargs)``; when autocast is on for ``x``'s device, ``x`` is 16-bit and autograd
    records, only ``x`` (and the tensors among ``args``) are kept for backward and ``function`` is recomputed there.

    ``function`` must draw no random numbers (the RNG state is not restored for the recomputation).
    Numerically identical to calling ``function`` directly.
    """
    if torch.is_grad_enabled() and x.dtype in SIXTEEN_BITS and torch.is_autocast_enabled(x.device.type):
        return checkpoint(function, x, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return function(x, *args, **kwargs)
