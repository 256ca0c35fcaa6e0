"""What Muon adds to a rank's step: Newton–Schulz FLOPs on the matrices it owns and the bytes it sends to gather them
whole and scatter the results (:mod:`lightning_seqpar.optim.matrix_owners`).

Per ``[n, m]`` matrix, ``k = min(n, m)``, ``l = max(n, m)``, each of the ``steps`` iterations of torch's quintic
Newton–Schulz runs ``X·Xᵀ`` (``2k²l``), ``b·A + c·A·A`` (``2k³``) and ``a·X + B·X`` (``2k²l``): ``steps·(4k²l + 2k³)``
FLOPs. The owners spread the matrices of a group of ``g`` ranks evenly, so a rank runs ``1/g`` of its group's
(``g = t`` for a dense matrix, split or replicated; ``g = expert_tp`` for an expert's, each rank running its
``E/ep`` experts'). Bytes a rank sends, averaged over its group (bfloat16 pieces): a split matrix of ``N`` elements
``2·(g − 1)·N/g²·2``, a replicated one ``(g − 1)·N/g·2``.
"""

from __future__ import annotations

from typing import Iterable

from lightning_seqpar.plan.pricing.model_inventory import ParameterEntry
from lightning_seqpar.plan.pricing.state import is_muon_matrix

NS_STEPS = 5  # torch.optim.Muon's default


def newton_schulz_flops(n: int, m: int, steps: int = NS_STEPS) -> float:
    """FLOPs of one orthogonalisation of an ``[n, m]`` matrix (see the module)."""
    k, l = min(n, m), max(n, m)
    return float(steps * (4 * k * k * l + 2 * k ** 3))


def muon_step_cost(entries: Iterable[ParameterEntry], tp: int, ep: int = 1, expert_tp: int = 1,
                   data: int = 1) -> tuple[float, float]:
    """``(FLOPs, bytes sent)`` of one rank's Muon step over ``entries`` (the parameters it holds; see the module).
    ``data``: under ``zero=1``, the data-parallel ranks (``d·c``) whose element ranges of each matrix one of them
    gathers first (:mod:`~lightning_seqpar.optim.range_owners`): a rank then runs ``1/(g·d)`` of the
    orthogonalisations (an expert's, ``1/(etp·edp)``), and sends ``2·(d − 1)·n/d²`` bfloat16 elements of each
    ``n``-element shard besides its ``1/d`` share of the tensor-parallel exchange."""
    flops = sent = 0.0
    for e in entries:
        if not (e.trainable and is_muon_matrix(e)):
            continue
        matrices = 1
        for size in e.shape[:-2]:
            matrices *= size
        full = e.numel
        if e.expert:
            group = expert_tp if e.split == "expert_width" else 1
            matrices, full = matrices // ep, full // ep
            replicas = max(1, tp * data // (ep * expert_tp)) if data > 1 else 1
        else:
            group, replicas = tp, data
        flops += matrices * newton_schulz_flops(*e.shape[-2:]) / (group * replicas)
        split = e.split in ("column", "row", "expert_width")
        sent += (2 * (group - 1) * full / group ** 2 if split else (group - 1) * full / group) * 2 / replicas
        shard = full / group if split else full
        sent += 2 * (replicas - 1) * shard / replicas ** 2 * 2
    return flops, sent
