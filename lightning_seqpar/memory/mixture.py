"""What a mixture of experts in a layer's MLP place keeps for backward on one rank, term by term (bytes).

The terms are those of :class:`~lightning_seqpar.transformer.moe_part.MoEPart` with the reference GPT's softmax top-k
router (:class:`~lightning_seqpar.models.gpt_moe.TopKRouter`, Mixtral's) and the dropless all-to-all dispatcher
(:class:`~lightning_seqpar.moe.dispatch.TokenDispatcher`), measured storage by storage (views counted once). With
``n`` the rank's tokens (``s·b/t`` under sequence parallelism, ÷c under context parallelism), ``N = n·k·etp`` the
(token, expert) pairs it sends (each pair to every slice of its expert's width), ``R`` the rows its experts receive,
``f/etp`` the width of its expert slices and ``e`` bytes per activation element:

- router: the logits ``[n, E]`` (kept for the load-balancing loss), their float32 softmax ``[n, E]``, the top-k scores
  (float32) and experts (int64) ``[n, k]``, the scores' sums (float32) ``[n]`` and the routing weights ``[n, k·etp]``;
- dispatch: each pair's slice (int64) ``[N]`` and the received rows' order (int64) ``[R]``;
- experts: the rows ``[R, h]`` and the grouped GEMM's int32 offsets ``[E/ep]`` (``expert_fc1``); the gate/up output
  ``[R, 2f/etp]`` and the gate's activation ``[R, f/etp]`` (``moe_act``); the down projection's input ``[R, f/etp]``;
- combine: the two orders (int64) ``[R]`` and ``[N]``, and every pair's output ``[N, h]`` (weighted in backward).

Balanced routing receives what it sends (``R = N``); a step's R varies with the router (:attr:`MixtureShape.rows`
takes a measured one). With an expert capacity (:class:`~lightning_seqpar.moe.capacity.CapacityDispatcher`) every
buffer has a fixed size: ``R = E·etp·C`` rows, ``C = ⌈capacity_factor·n·k/E⌉``, padding included, whatever the routing;
the dispatch keeps each pair's slot and slice (int64) ``[N]`` and its token's row ``[N, h]`` instead of the orders.
A family's own router keeps its own tensors (``[n, E]`` and ``[n, k]`` sized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class MixtureShape:
    """The sizes of a mixture of experts in a layer's MLP place (Megatron-Core's ``num_moe_experts``, ``moe_router_topk``,
    ``moe_ffn_hidden_size``, ``expert_model_parallel_size``, ``expert_tensor_parallel_size``)."""

    num_experts: int
    """E, experts per layer (all ranks)"""
    top_k: int
    """k, experts each token goes to"""
    expert_ffn: int
    """f, each expert's width (whole, before ``expert_tp`` splits it)"""
    ep: int = 1
    """expert-parallel size"""
    expert_tp: int = 1
    """expert tensor-parallel size"""
    rows: Optional[float] = None
    """R, the rows this rank's experts receive per micro-batch; ``None``: balanced routing (``N``)"""
    grouped: bool = True
    """the grouped GEMM (16- and 32-bit experts) keeps its int32 offsets; the loop over experts (float64) none"""
    capacity_factor: Optional[float] = None
    """``None``: dropless dispatch; else each expert's capacity per source rank (Megatron-Core's
    ``moe_expert_capacity_factor``, padded to capacity)"""

    def pairs(self, n: float) -> float:
        """N, the (token, expert) pairs ``n`` tokens send: one per expert slice."""
        return n * self.top_k * self.expert_tp

    def received(self, n: float) -> float:
        """R, the rows this rank's experts receive: :attr:`rows`; ``E·etp·C`` under a capacity; else ``N`` (balanced
        routing)."""
        if self.rows is not None:
            return self.rows
        if self.capacity_factor is not None:
            return self.num_experts * self.expert_tp * math.ceil(self.capacity_factor * n * self.top_k / self.num_experts)
        return self.pairs(n)


EXPERT_OFFLOAD_TERMS = {
    "expert_fc1": ("expert rows",),
    "moe_act": ("expert gate and up", "expert activation output"),
}
"""The terms of :func:`mixture_terms` each offloaded expert module moves to host memory."""

EXPERT_OFFLOAD_COPIES = {"expert_fc1": ("expert offsets (int32)",)}
"""Terms an offloaded expert module copies to host memory that stay on the device too: the gate/up projection's grouped
GEMM saves the offsets, and so does the down projection's, outside the region."""


def mixture_terms(mixture: MixtureShape, n: float, h: int, bytes_per_element: int,
                  modules: Sequence[str] = ()) -> dict[str, float]:
    """Bytes the mixture keeps for backward for ``n`` tokens of hidden size ``h`` (the module docstring's terms).

    ``modules``: recomputation by module: ``"moe_act"`` keeps only the gate/up output of the experts' activation
    (its output and the down projection's input made again in backward); ``"moe"`` keeps only the router's logits
    (the mixture's input is the norm's output, counted with the layer).
    """
    e, E, k, etp = bytes_per_element, mixture.num_experts, mixture.top_k, mixture.expert_tp
    pairs, rows, width = mixture.pairs(n), mixture.received(n), mixture.expert_ffn / etp
    if "moe" in modules:
        return {"router logits": e * n * E}
    terms = {
        "router logits": e * n * E,
        "router probabilities (float32)": 4 * n * E,
        "top-k scores (float32)": 4 * n * k,
        "top-k experts (int64)": 8 * n * k,
        "top-k score sums (float32)": 4 * n,
        "routing weights": e * n * k * etp,
        "pair slices (int64)": 8 * pairs,
        "expert rows": e * rows * h,
        "expert gate and up": 2 * e * rows * width,
        "expert activation output": e * rows * width,
        "expert fc2 input": e * rows * width,
        "pair outputs": e * pairs * h,
    }
    if mixture.capacity_factor is None:
        terms.update({"received order (int64)": 8 * rows, "combine orders (int64)": 8 * (rows + pairs)})
    else:
        terms.update({"pair slots (int64)": 8 * pairs, "pair inputs": e * pairs * h})
    if mixture.grouped:
        terms["expert offsets (int32)"] = 4 * E / mixture.ep
    if "moe_act" in modules:
        del terms["expert activation output"], terms["expert fc2 input"]
    return terms
