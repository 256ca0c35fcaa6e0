"""The memory choices a user makes per layer (recomputation by module, activation offload) and the bytes each leaves on
the device and moves to host memory: one table, read by :func:`lightning_seqpar.explain`, the memory report and the
planner's trades.

The figures are :func:`~lightning_seqpar.memory.activations.layer_activation_terms` and
:func:`~lightning_seqpar.memory.activations.offloaded_activation_terms` (the paper's §4.1 terms, split by the module
that saves each), which the saved-tensor tracker matches to the byte on the rewritten layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from lightning_seqpar.memory.activations import (Recompute, TransformerShape, layer_activation_terms,
                                                 offloaded_activation_terms)
from lightning_seqpar.memory.mixture import MixtureShape

MEMORY_CHOICES: Mapping[str, tuple[Recompute, tuple[str, ...], tuple[str, ...]]] = {
    "none": ("none", (), ()),
    "selective": ("selective", (), ()),
    "selective + layernorm": ("selective", ("layernorm",), ()),
    "selective + mlp": ("selective", ("mlp",), ()),
    "selective + layernorm + mlp": ("selective", ("layernorm", "mlp"), ()),
    "selective | offload attn_norm, mlp_norm": ("selective", (), ("attn_norm", "mlp_norm")),
    "selective | offload all but core_attn": ("selective", (), ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm",
                                                               "mlp")),
    "none | offload all": ("none", (), ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp")),
    "full": ("full", (), ()),
}
"""``{label: (recompute, recomputed by module, offloaded)}``: the paper's two choices, no recomputation, and the
module-level ones users pick between (``SelectiveRecompute(modules=...)``, ``ActivationOffload(modules=...)``)."""

MIXTURE_CHOICES: Mapping[str, tuple[Recompute, tuple[str, ...], tuple[str, ...]]] = {
    "none": ("none", (), ()),
    "selective": ("selective", (), ()),
    "selective + layernorm": ("selective", ("layernorm",), ()),
    "selective + moe_act": ("selective", ("moe_act",), ()),
    "selective + moe": ("selective", ("moe",), ()),
    "selective + layernorm + moe": ("selective", ("layernorm", "moe"), ()),
    "selective | offload attn_norm, mlp_norm": ("selective", (), ("attn_norm", "mlp_norm")),
    "selective | offload expert_fc1, moe_act": ("selective", (), ("expert_fc1", "moe_act")),
    "selective | offload all but core_attn": ("selective", (), ("attn_norm", "qkv_linear", "attn_proj", "mlp_norm",
                                                               "expert_fc1", "moe_act")),
    "none | offload all": ("none", (), ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
                                        "moe_act")),
    "full": ("full", (), ()),
}
"""The same for a layer whose MLP is a mixture of experts: the experts' activation or the whole mixture recomputed,
the experts' inputs offloaded (:mod:`lightning_seqpar.memory.mixture`)."""


@dataclass(frozen=True)
class ChoiceBytes:
    """One memory choice: bytes per layer and micro-batch on one rank."""

    choice: str
    device_bytes: float
    """kept on the device for backward"""
    host_bytes: float
    """copied to host memory in the forward and back in the backward"""


def choice_bytes(shape: TransformerShape, t: int, sequence_parallel: bool, bytes_per_element: int = 2, c: int = 1,
                 choices: Optional[Mapping[str, tuple[Recompute, tuple[str, ...], tuple[str, ...]]]] = None,
                 norm_statistics_bytes: int = 0, experts: Optional[MixtureShape] = None) -> list[ChoiceBytes]:
    """Each of ``choices`` (default :data:`MEMORY_CHOICES`, or :data:`MIXTURE_CHOICES` with ``experts``) for a layer of
    ``shape`` (``s`` the whole sequence, ``b`` the micro-batch; its MLP a mixture of ``experts``, balanced routing, or
    dense) on one rank of ``t`` tensor-parallel (with or without SP) and ``c`` context-parallel ranks;
    ``norm_statistics_bytes`` as :func:`~lightning_seqpar.memory.activations.layer_activation_terms` (4 on CUDA). A
    choice that cannot be made at this layout (core attention offloaded where it is recomputed) is left out.
    """
    rows = []
    if choices is None:
        choices = MEMORY_CHOICES if experts is None else MIXTURE_CHOICES
    for label, (recompute, modules, offload) in choices.items():
        options = dict(t=t, sequence_parallel=sequence_parallel, recompute=recompute,
                       bytes_per_element=bytes_per_element, c=c, modules=modules, offload=offload,
                       norm_statistics_bytes=norm_statistics_bytes, experts=experts)
        try:
            rows.append(ChoiceBytes(label, sum(layer_activation_terms(shape, **options).values()),
                                    sum(offloaded_activation_terms(shape, **options).values())))
        except ValueError:
            continue
    return rows


def format_choices(rows: list[ChoiceBytes]) -> str:
    """``rows`` as aligned text lines: the choice, MiB on the device and MiB moved each way."""
    width = max(len(r.choice) for r in rows)
    lines = [f"  {'choice':<{width}}  {'device MiB':>10}  {'host MiB':>9}"]
    lines += [f"  {r.choice:<{width}}  {r.device_bytes / 2**20:>10.3f}  {r.host_bytes / 2**20:>9.3f}" for r in rows]
    return "\n".join(lines)
