"""FLOPs per iteration and FLOPs utilization: Korthikanti et al. 2022, Appendix A and §6.3.

GEMM FLOPs only (2 per multiply-add), following Narayanan et al. 2021; backward costs twice the forward.
"""

from __future__ import annotations

from lightning_seqpar.memory.activations import Recompute, TransformerShape


def layer_forward_flops(shape: TransformerShape, batch: int) -> float:
    """Forward FLOPs of one layer for ``batch`` sequences.

    Query and output projections ``2·2Bsh²``, key and value projections ``2·2Bsh·(g/a)h`` (g key/value heads),
    QKᵀ and attention over V ``2·2Bs²h``, the MLP ``2Bshf`` per matrix (2 matrices, or 3 gated). With g = a and
    two matrices of f = 4h: ``24Bsh² + 4Bs²h``, the paper's Appendix A.
    """
    s, h, f = shape.s, shape.h, shape.f
    kv = 2 * h * shape.g // shape.a  # the key and value projections' output features
    matrices = 3 if shape.gated_mlp else 2
    return 2 * batch * s * h * (2 * h + kv + matrices * f) + 4 * batch * s * s * h


def model_flops_per_iteration(shape: TransformerShape, batch: int) -> float:
    """Eq. 7: FLOPs of one forward + backward, independent of implementation.

    ``72·B·L·s·h²·(1 + s/(6h) + v/(12hL))`` for f = 4h, multi-head attention and two MLP matrices; in general
    three times (:func:`layer_forward_flops` per layer + the logits' ``2Bshv``). ``batch`` is the global batch B.
    """
    logits = 2 * batch * shape.s * shape.h * shape.v
    return 3 * (shape.L * layer_forward_flops(shape, batch) + logits)


def hardware_flops_per_iteration(shape: TransformerShape, batch: int, recompute: Recompute = "selective") -> float:
    """FLOPs executed per iteration, recomputation included.

    * ``"none"``: Eq. 7.
    * ``"selective"``: Eq. 8 **as printed**, ``72BLsh²(1 + s/(3h) + v/(12hL))``. It adds 12BLs²h, a full
      forward + backward of QKᵀ and ·V, though re-running their forward is 4BLs²h; Table 5's HFU and the
      2.7% / 1.6% overheads of §5 follow the printed form, so it is kept.
    * ``"full"``: one more forward of every layer, ``96BLsh²(1 + s/(6h) + v/(16hL))`` (Narayanan et al. 2021).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}.")
    selective = shape.L if recompute == "selective" else 0
    full = shape.L if recompute == "full" else 0
    return model_flops_per_iteration(shape, batch) + recompute_flops(shape, batch, selective, full)


def mlp_forward_flops(shape: TransformerShape, batch: int) -> float:
    """Forward FLOPs of one layer's MLP for ``batch`` sequences: ``2Bshf`` per matrix (2, or 3 gated)."""
    return 2 * batch * shape.s * shape.h * shape.f * (3 if shape.gated_mlp else 2)


def recompute_flops(shape: TransformerShape, batch: int, selective_layers: int = 0, full_layers: int = 0,
                    mlp_layers: int = 0) -> float:
    """FLOPs recomputation adds: ``12Bs²h`` per selective layer (Eq. 8 as printed), one forward per full layer, one
    MLP forward per layer whose MLP is recomputed by module (:func:`mlp_forward_flops`)."""
    return (selective_layers * 12 * batch * shape.s ** 2 * shape.h + full_layers * layer_forward_flops(shape, batch)
            + mlp_layers * mlp_forward_flops(shape, batch))


def recompute_flops_overhead(shape: TransformerShape, recompute: Recompute = "selective") -> float:
    """Extra FLOPs of recomputation as a fraction of the model FLOPs (§5: 2.7% for GPT-3, 1.6% for MT-NLG)."""
    return hardware_flops_per_iteration(shape, 1, recompute) / model_flops_per_iteration(shape, 1) - 1


def flops_utilization(flops_per_iteration: float, iteration_time_s: float, devices: int, peak_flops_per_device: float) -> float:
    """MFU (with model FLOPs) or HFU (with hardware FLOPs): achieved FLOP/s over the devices' peak FLOP/s.

    Raises:
        ValueError: a non-positive time, device count or peak.
    """
    if iteration_time_s <= 0 or devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(
            f"need iteration_time_s > 0, devices >= 1 and peak_flops_per_device > 0; got {iteration_time_s}, "
            f"{devices}, {peak_flops_per_device}."
        )
    return flops_per_iteration / iteration_time_s / (devices * peak_flops_per_device)
