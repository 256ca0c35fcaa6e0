"""Count calls of chosen aten operations with a dispatch mode (what runs, not how long)."""

import torch

from lightning_seqpar._compat import SCALAR_READ as HOST_READ  # noqa: F401 - behind .item(), float() of a tensor
from lightning_seqpar._compat import TorchDispatchMode

CAT = torch.ops.aten.cat.default


class OpCounter(TorchDispatchMode):
    """While active, ``counts[name]`` counts the calls of each operation of ``ops`` (``{operation: name}``)."""

    def __init__(self, ops: dict) -> None:
        super().__init__()
        self.ops = ops
        self.counts = {name: 0 for name in ops.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.counts[self.ops[func]] += 1
        return func(*args, **(kwargs or {}))
