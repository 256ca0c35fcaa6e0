"""What a pipelined step logs: recorded on the last stage, averaged over micro-batches, shared as one tensor.

The user's ``self.log`` calls run where the loss is computed, on the last stage; every rank must log the same
names (``sync_dist`` collectives line up across ranks). The values stay tensors on the device: no ``float()`` /
``.item()`` reads them back to the host inside the step (Lightning reads them when it reports). What is logged
(names, dtypes, ``self.log`` arguments) is a Python structure, sent from the last stage once per kind of step
(training; evaluation: once per validation or test loop, since loops may log differently); afterwards each step
broadcasts one float64 tensor of the values over the pipeline group.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup

Structure = tuple[tuple[str, Optional[torch.dtype], tuple[tuple[str, Any], ...]], ...]


class LogRecorder:
    """Stands in for ``LightningModule.log`` during a schedule; keeps the calls of the last stage, as tensors.

    Raises (when called):
        TypeError: options passed by position, or a value that is not a number or a one-element tensor.
    """

    def __init__(self) -> None:
        self.calls: dict[str, tuple[list[Tensor], Optional[torch.dtype], dict]] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("Under pipeline parallelism pass self.log options by keyword.")
        if isinstance(value, Tensor) and value.numel() == 1:
            number, dtype = value.detach().reshape(()).to(torch.float64), value.dtype
        elif isinstance(value, numbers.Number):
            number, dtype = torch.tensor(float(value), dtype=torch.float64), None
        else:
            raise TypeError(
                f"self.log('{name}', {type(value).__name__}) inside a pipelined step: values logged there are averaged "
                f"over micro-batches, so they must be numbers or one-element tensors. Log metric objects in an epoch hook."
            )
        entry = self.calls.setdefault(name, ([], dtype, kwargs))
        entry[0].append(number)

    def structure(self) -> Structure:
        """Names, dtypes and ``self.log`` arguments, in call order."""
        return tuple((name, dtype, tuple(sorted(kwargs.items()))) for name, (_, dtype, kwargs) in self.calls.items())

    def means(self, device: torch.device) -> list[Tensor]:
        """Each name's mean over micro-batches, float64 on ``device``."""
        return [torch.stack([v.to(device) for v in values]).mean() for values, _, _ in self.calls.values()]


class LogShare:
    """Gives every pipeline rank the last stage's step loss and logged means, as tensors (see the module docstring).

    Args:
        group: the pipeline-parallel group.
        last_rank: the pipeline rank of the last stage.
    """

    def __init__(self, group: ParallelGroup, last_rank: int) -> None:
        self.group, self.last_rank = group, last_rank
        self._structures: dict[str, tuple[Optional[torch.dtype], Structure]] = {}

    def loss_dtype(self, kind: str) -> Optional[torch.dtype]:
        """The dtype of the last stage's loss in steps of ``kind`` (known after the first one)."""
        return self._structures[kind][0]

    def dtypes(self, kind: str) -> dict[str, Optional[torch.dtype]]:
        """Each logged name's dtype (``None`` for a Python number) in steps of ``kind``."""
        return {name: dtype for name, dtype, _ in self._structures[kind][1]}

    def forget(self, kind: str) -> None:
        """The next step of ``kind`` teaches its layout again (every rank calls it at the same point: a loop's start)."""
        self._structures.pop(kind, None)

    def share(self, kind: str, loss: Optional[Tensor], recorder: Optional[LogRecorder],
              device: torch.device) -> tuple[Optional[Tensor], list[tuple[str, Tensor, dict]]]:
        """On the last stage, ``loss`` (the step's mean loss, or ``None``) and ``recorder``; elsewhere ``None``s.
        Returns the loss (float64) and ``(name, mean, self.log kwargs)`` on every rank.

        Raises:
            ValueError: on the last stage, a step of ``kind`` that logs other names, dtypes or arguments than the
                first one did (the other stages learnt the layout of the values from it).
        """
        is_last = self.group.rank == self.last_rank
        mine = (loss.dtype if loss is not None else None, recorder.structure()) if is_last else None
        if kind not in self._structures:
            box = [mine]
            if self.group.size > 1:
                dist.broadcast_object_list(box, src=dist.get_global_rank(self.group.group, self.last_rank),
                                           group=self.group.group)
            self._structures[kind] = box[0]
        loss_dtype, structure = self._structures[kind]
        if is_last and mine != (loss_dtype, structure):
            raise ValueError(
                f"Under pipeline parallelism every {kind} step must log the same names, dtypes and self.log arguments "
                f"(the other stages learnt them from the first step): first {structure}, now {mine[1]}."
            )
        count = (loss_dtype is not None) + len(structure)
        if count == 0:
            return None, []
        if is_last:
            values = torch.stack(([loss.detach().to(device, torch.float64)] if loss is not None else [])
                                 + recorder.means(device))
        else:
            values = torch.empty(count, dtype=torch.float64, device=device)
        self.group.broadcast(values, src_rank=self.last_rank)
        shared_loss = values[0] if loss_dtype is not None else None
        logged = values[1:] if loss_dtype is not None else values
        return shared_loss, [(name, logged[i], dict(kwargs)) for i, (name, _, kwargs) in enumerate(structure)]
