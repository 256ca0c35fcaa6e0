"""Optimizers over split parameters: element-wise ones as they are, Muon made exact, every other one refused.

An optimizer sees this rank's shard of a split parameter as if it were the parameter. For an element-wise update
(:data:`~lightning_seqpar.optim.distributed_optimizer.ELEMENTWISE`: SGD, Adam, AdamW, ...) that is exact. For one that
reads more than an element it is silently another optimizer: Muon orthogonalises each matrix whole, Adafactor
factors a matrix's second moment by rows and columns, LAMB and LARS scale by a tensor's norm, Shampoo and SOAP
precondition by a matrix's statistics. So before the first step (:func:`exact_or_refused`, from
:class:`~lightning_seqpar.optim.grad_sync.GradientSync`) each optimizer is kept, replaced by its exact sharded form
(``torch.optim.Muon`` → :class:`~lightning_seqpar.optim.sharded_muon.ShardedMuon`; the library's own
:class:`~lightning_seqpar.optim.muon.Muon` placed on the mesh), or refused by name with the fix.
Where no parameter is split over more than one rank (data-parallel replicas, pipeline stages alone) every optimizer
sees whole parameters and is kept.

An optimizer class of one's own that updates element by element says so with a class attribute ``elementwise =
True``; it is then kept as the built-in ones are.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_seqpar.optim.distributed_optimizer import ELEMENTWISE, repoint_schedulers
from lightning_seqpar.optim.muon import Muon
from lightning_seqpar.optim.sharded_muon import ShardedMuon
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import inner_spec, placement_of, shard_spec


def is_elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` updates each element from that element alone: a class of :data:`ELEMENTWISE`, or one
    that declares ``elementwise = True``."""
    return type(optimizer) in ELEMENTWISE or getattr(type(optimizer), "elementwise", False) is True


def split_parameters(optimizer: Optimizer, names: Mapping[int, str], mesh: ParallelMesh) -> list[str]:
    """The parameters of ``optimizer`` split over a group of more than one rank, each as ``"name (over tp: 2)"``."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            placement = placement_of(p)
            over = [f"{name}: {mesh.group(name).size}" for name, spec in (
                (placement.shard_over, shard_spec(p)), (placement.inner_over, inner_spec(p)))
                if spec is not None and mesh.group(name).size > 1]
            if over:
                out.append(f"{names.get(id(p), tuple(p.shape))} (over {', '.join(over)})")
    return out


def exact_or_refused(optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any], module: nn.Module,
                     mesh: ParallelMesh) -> list[Optimizer]:
    """``optimizers`` as the run steps them (see the module): element-wise ones and ones over whole parameters
    unchanged, ``torch.optim.Muon`` over split ones as :class:`ShardedMuon` (the schedulers re-pointed at it).

    Raises:
        ValueError: an optimizer that is neither element-wise nor Muon over a split parameter, naming the class, the
            parameters and the fix; from :class:`ShardedMuon`.
    """
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out: list[Optimizer] = []
    for optimizer in optimizers:
        if isinstance(optimizer, Muon):  # the library's own: told where its matrices are split
            optimizer.place(mesh)
            out.append(optimizer)
            continue
        split = [] if is_elementwise(optimizer) else split_parameters(optimizer, names, mesh)
        if not split or isinstance(optimizer, ShardedMuon):
            out.append(optimizer)
        elif type(optimizer) is torch.optim.Muon:
            out.append(ShardedMuon(optimizer, mesh))
        else:
            shown = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
            raise ValueError(
                f"{type(optimizer).__name__} is not an element-wise optimizer, and it would update {shown} from this "
                f"rank's shard as if it were the whole parameter: silently another optimizer. Element-wise optimizers "
                f"({', '.join(c.__name__ for c in ELEMENTWISE)}) are exact on shards, and torch.optim.Muon and "
                f"lightning_seqpar.optim.Muon are made exact; use one of those for the split parameters (another "
                f"optimizer over the rest), or tp=1 and ep=1 so that no parameter is split. A class of your own that "
                f"does update element by element: set the class attribute elementwise = True.")
    repoint_schedulers(lr_scheduler_configs, optimizers, out)
    return out
