"""What a mixture of experts adds to a layout's price: the expert grids a layout can take, the all-to-all bytes of
its dispatch, and what expert tensor parallelism adds to a layer's activations over the probe's whole experts (the
probe measures every expert on one rank: :mod:`..measuring.probe`). Model-state bytes of experts are :mod:`.state`'s.
"""

from __future__ import annotations

from typing import Any

from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.rules import divisors


def expert_parallel_sizes(inventory: ModelInventory, ranks: int) -> list[int]:
    """The expert-parallel sizes a layout of ``ranks = t·c·d`` ranks per pipeline stage can take: divisors of ``ranks``
    that divide the expert count (the expert grid folds over the dense one); ``[1]`` for a dense model."""
    if inventory.experts is None:
        return [1]
    return [e for e in divisors(ranks) if inventory.experts.num_experts % e == 0]


def expert_grids(inventory: ModelInventory, ranks: int) -> list[tuple[int, int]]:
    """The ``(ep, expert_tp)`` pairs a layout of ``ranks = t·c·d`` ranks per pipeline stage can take: each
    :func:`expert_parallel_sizes` ``e`` with every divisor of ``ranks / e`` that divides the expert width (each
    expert's width split over ``expert_tp`` ranks); ``[(1, 1)]`` for a dense model."""
    if inventory.experts is None:
        return [(1, 1)]
    return [(e, w) for e in expert_parallel_sizes(inventory, ranks) for w in divisors(ranks // e)
            if inventory.experts.expert_ffn % w == 0]


def expert_tensor_parallel_bytes(inventory: ModelInventory, record: Any, s: int, element: int) -> float:
    """What expert tensor parallelism adds to a layer's activations per micro-batch (bytes), over the probe's whole
    experts: each of a rank's ``n·k`` pairs (``n = s·b/t`` tokens) becomes ``etp`` width slices, so the rows its
    experts keep the input of (``[R, h]``, the first projection's) and the rows the combine keeps (``[n·k, h]``, each
    pair's output, weighted by its score) are ``etp`` times as many; each slice's inner activations are ``1/etp`` as
    wide, so those stay (:mod:`lightning_seqpar.moe.dispatch`, ``expert_tensor_parallel_pairs``); nothing under full
    recomputation."""
    experts = inventory.experts
    lay = record.layout
    if experts is None or lay.expert_tp == 1 or lay.recompute == "full" or "moe" in lay.recompute_modules:
        return 0.0
    pairs = s * record.micro_batch / record.layout.tp * experts.top_k
    return 2 * (record.layout.expert_tp - 1) * pairs * inventory.hidden_size * element


def expert_layer_elements(inventory: ModelInventory) -> int:
    """Elements of one layer's experts, all E of them (their packed weights and biases); 0 for a dense model."""
    def count() -> int:
        layer = next((e.layer for e in inventory.entries if e.expert), None)
        return sum(e.numel for e in inventory.entries if e.expert and e.layer == layer)

    return inventory.derived(("expert layer elements",), count)


def all_to_all_bytes(inventory: ModelInventory, record: Any, s: int, element: int,
                     held: list) -> float:
    """Bytes one rank sends per micro-batch in its mixtures' all-to-alls: each of its ``n = s·b/t`` tokens'
    ``k`` (token, expert) pairs travels, as ``etp`` width slices, to the ranks holding them unless one is this one,
    ``(e·etp − 1)/(e·etp)`` of them under balanced routing, ``h`` elements each; per MoE layer the forward's dispatch and combine and the backward's two
    (three and three under full recomputation, which dispatches again)."""
    experts = inventory.experts
    width = record.layout.ep * record.layout.expert_tp  # the etp_ep group a pair's etp width slices are sent over
    if experts is None or width == 1:
        return 0.0
    layers = len({e.layer for e in held if e.expert})
    pairs = s * record.micro_batch / record.layout.tp * experts.top_k * record.layout.expert_tp * (width - 1) / width
    passes = 6 if record.layout.recompute == "full" else 4
    return layers * passes * pairs * inventory.hidden_size * element
