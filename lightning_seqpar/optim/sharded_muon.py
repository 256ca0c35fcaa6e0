"""``torch.optim.Muon`` over tensor-parallel shards, exact: each matrix orthogonalised whole, once, by one owner.

Muon (Jordan et al. 2024; ``torch.optim.Muon``) updates a matrix by ``NS(B̃)``, the Newton–Schulz orthogonalisation of
its Nesterov momentum, scaled by a learning rate adjusted to the matrix's shape. The momentum is element-wise, so each
rank keeps it for its own shard; the orthogonalisation reads the whole matrix and the adjustment its single-device
shape, so run on a ``[n/t, m]`` shard both are something else (no error, a different model). :class:`ShardedMuon`
keeps torch's algorithm and state (``momentum_buffer`` shaped like the shard, so checkpoints reshard it as they do
AdamW's moments) and orthogonalises through :func:`~lightning_seqpar.optim.matrix_owners.process_whole`: each
matrix's bfloat16 update (torch casts to bfloat16 first, so nothing is lost in sending it so) assembled on one owner
rank per matrix, orthogonalised there by torch's own function, its pieces sent back. The result equals one process's
``torch.optim.Muon`` on the single-device model up to the rounding of the gradients themselves.

Which matrices travel: a 2-D parameter split over a group of more than one rank (tp; expert_tp for an expert's width)
to its owner in that group; one split nowhere (a router) is orthogonalised by one owner in the tensor-parallel group
and sent whole to the others; both cases once per model replica. Newton–Schulz runs are counted in
:attr:`ShardedMuon.newton_schulz_runs` (per rank, cumulative).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_seqpar._compat import muon_adjusted_lr, muon_orthogonalise
from lightning_seqpar.optim.matrix_owners import Matrix, process_whole
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.parallel.placement import ShardSpec, inner_spec, placement_of, shard_spec
from lightning_seqpar.tensor_parallel.sharding import full_shape

_LOCAL = ParallelGroup(None)  # a group of one rank: matrices whole where they are


def matrix_split(param: Tensor, mesh: ParallelMesh) -> tuple[str, Optional[ShardSpec]]:
    """The group over which ``param``'s matrix is split and the split (a :class:`ShardSpec` of one of its last two
    dims), or ``("tp", None)`` for a parameter split nowhere (whole on every tensor-parallel rank), or
    ``("", None)`` for one split only along a stack's dim (experts over ep: each rank's matrices are whole).

    Raises:
        ValueError: a matrix split along both of its dims (over two groups of more than one rank).
    """
    placement = placement_of(param)
    outer, inner = shard_spec(param), inner_spec(param)
    splits = [(name, spec) for name, spec in ((placement.shard_over, outer), (placement.inner_over, inner))
              if spec is not None and mesh.group(name).size > 1]
    matrix = [(name, spec) for name, spec in splits if spec.dim >= param.dim() - 2]
    if len(matrix) > 1:
        raise ValueError(f"A matrix of shape {tuple(param.shape)} split over {matrix[0][0]} and {matrix[1][0]}: Muon "
                         f"gathers a matrix split over one group. Split it once (expert_tp=1 or tp=1).")
    if matrix:
        return matrix[0]
    return ("", None) if splits or outer is not None or inner is not None else ("tp", None)


def orthogonalised(entries: Sequence[tuple[Tensor, Tensor, tuple]], splits: dict[int, tuple[str, Optional[ShardSpec]]],
                   mesh: Optional[ParallelMesh], counted: Callable[[int], None]) -> list[Tensor]:
    """The Newton–Schulz orthogonalisation of each single-device matrix of ``entries`` (``(parameter, this rank's
    update, (coefficients, steps, eps))``), as this rank's piece (bfloat16, shaped like the update); a 3-D stack
    (experts ``[E, n, m]``) per matrix. ``splits``: each parameter's :func:`matrix_split` (``mesh`` ``None``: every
    matrix whole here). ``counted(n)``: told of the ``n`` runs this rank makes. Collective over the groups of the
    splits, in their names' order (the same on every rank).

    Source: ``torch.optim.Muon`` (``_zeropower_via_newtonschulz``, run by torch's own function).
    """
    work: dict[tuple, list[int]] = {}
    for index, (p, _, settings) in enumerate(entries):
        name = splits[id(p)][0] if mesh is not None else ""
        work.setdefault((name, settings), []).append(index)
    out: list[Optional[Tensor]] = [None] * len(entries)
    for (name, (coefficients, steps, eps)), indices in sorted(work.items(), key=lambda kv: kv[0][0]):
        def orthogonalise(matrix: Tensor) -> Tensor:
            if matrix.dim() == 2:
                counted(1)
                return muon_orthogonalise(matrix, coefficients, steps, eps)
            counted(matrix.shape[0])
            return torch.stack([muon_orthogonalise(m, coefficients, steps, eps) for m in matrix])

        group = mesh.group(name) if mesh is not None and name else _LOCAL
        matrices = [Matrix(entries[i][1], splits[id(entries[i][0])][1] if mesh is not None else None)
                    for i in indices]
        for i, result in zip(indices, process_whole(matrices, group, orthogonalise, torch.bfloat16)):
            out[i] = result
    return out  # type: ignore[return-value]


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], param: Tensor) -> float:
    """Muon's learning rate for ``param``'s matrices, by their single-device shape (the last two dims of a stack)."""
    return muon_adjusted_lr(lr, adjust_lr_fn, torch.Size(full_shape(param)[-2:]))


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose parameters are this rank's shards (see the module): the same hyperparameters,
    state and ``state_dict``; each step orthogonalises every matrix whole.

    Args:
        optimizer: the ``torch.optim.Muon`` from ``configure_optimizers``, holding no state yet.
        mesh: the process groups the parameters are split over.

    Raises:
        ValueError: an optimizer that already holds state, or a matrix split along both dims.
    """

    def __init__(self, optimizer: torch.optim.Muon, mesh: ParallelMesh) -> None:
        if optimizer.state:
            raise ValueError("Muon over sharded parameters starts fresh; this one already holds state. Return a new "
                             "torch.optim.Muon from configure_optimizers.")
        super().__init__([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
        self.mesh = mesh
        self.newton_schulz_runs = 0
        self._splits = {id(p): matrix_split(p, mesh) for g in self.param_groups for p in g["params"]}

    def _count(self, runs: int) -> None:
        self.newton_schulz_runs += runs

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """``torch.optim.Muon.step`` with each update orthogonalised whole (collective over the tensor-parallel and
        expert-tensor-parallel groups of the parameters' splits)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_step(self, self.param_groups, lambda entries: orthogonalised(entries, self._splits, self.mesh,
                                                                           self._count))
        return loss


def muon_step(optimizer: Optimizer, groups: Sequence[dict[str, Any]],
              orthogonalise: Callable[[list[tuple[Tensor, Tensor, tuple]]], list[Tensor]],
              param_of: Callable[[Tensor], Tensor] = lambda p: p) -> None:
    """``torch.optim.Muon``'s update of ``groups``' parameters with a gradient: the momentum in ``optimizer``'s
    state (element-wise, on what the rank holds), ``orthogonalise`` of the ``(held tensor, update, (coefficients,
    steps, eps))`` entries (whole matrices, however it gathers them), decoupled weight decay, and the learning rate
    adjusted by the single-device shape of ``param_of(held tensor)`` (the parameter a zero=1 range is of)."""
    entries, owners = [], []
    for group in groups:
        settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
        for p in group["params"]:
            if p.grad is not None:
                entries.append((p, momentum_update(optimizer.state[p], p, group["momentum"], group["nesterov"]),
                                settings))
                owners.append(group)
    for (p, _, _), group, orthogonal in zip(entries, owners, orthogonalise(entries)):
        lr = float(group["lr"])
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(orthogonal, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param_of(p)))


def momentum_update(state: dict, param: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Muon's momentum step on ``param``'s gradient (element-wise: this rank's shard alone), in ``state``'s
    ``momentum_buffer``; the update to orthogonalise (Nesterov's, or the buffer).

    Raises:
        RuntimeError: a sparse gradient or a complex parameter, as torch's Muon.
    """
    grad = param.grad
    if grad.is_sparse or torch.is_complex(param):
        raise RuntimeError("Muon does not support sparse gradients or complex parameters")
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf
