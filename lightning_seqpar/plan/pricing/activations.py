"""Activation bytes per layer and micro-batch from Table 2 of Korthikanti et al. 2022 for the model's own sizes, and
what lives outside the layers (the planner's ``--analytic`` figures; the micro-batches in flight come from the rank's
own schedule, :mod:`..planner`).

Per layer and micro-batch (bytes; e bytes per activation element, ``split = t`` under sequence parallelism else 1):

- the region tensor parallelism leaves whole, split along s by SP: the two norms' inputs and the two projections'
  inputs, ``4·e·sbh / split``, and 1-byte dropout masks of the residual branches when they drop (``2·sbh / split``);
- the head- and feature-split region: q and the attention context ``2·e·sb·a·d / t``, k and v ``2·e·sb·g·d / t`` (g
  key/value heads), the MLP ``2·e·sbf / t`` (two matrices) or ``3·e·sbf / t`` (gated: gate, up and their product);
- core attention, unless recomputed (selective) or fused (SDPA keeps no ``s²`` tensor): the softmax output
  ``e·a·s²b / t``, and with attention dropout its mask and output ``(1 + e)·a·s²b / t``;
- full recomputation keeps the layer's input only, ``e·sbh / split``.

For a = g, f = 4h and dropouts everywhere the sum is Table 2's ``sbh(34/t + 5as/(ht))`` (e = 2). Outside the layers:
on the last rank the final norm's float32 copy and output of the gathered ``[b, s, h]`` stack output, ``(4 + e)·sbh``, and the
vocabulary-parallel loss's float32 logits and their softmax ``8·sbv / t``.

The per-layer figure here is the analytic one (``--analytic``); by default the planner measures the model's own layer
(:mod:`..measuring.probe`).
"""

from __future__ import annotations

from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.parallel.split_sizes import padded_size


def layer_bytes(inventory: ModelInventory, s: int, b: int, t: int, sequence_parallel: bool = True,
                recompute: str = "selective", element: int = 2, dropout: bool = False,
                modules: tuple[str, ...] = (), offload: tuple[str, ...] = ()) -> float:
    """Bytes one layer keeps for backward per micro-batch on one tensor-parallel rank, on the device (see the module
    docstring). ``modules``: recomputation by module beyond ``recompute`` (``"mlp"``, ``"moe"``: the MLP keeps its
    input only; ``"layernorm"``: the norms' outputs are not kept);
    ``offload``: modules whose saved tensors wait in host memory (:func:`offloaded_layer_bytes`).

    Raises:
        ValueError: an unknown ``recompute``.
    """
    terms = _layer_terms(inventory, s, b, t, sequence_parallel, recompute, element, dropout, modules)
    return sum(v for k, v in terms.items() if k not in offload)


def weight_gradient_bytes(inventory: ModelInventory, s: int, b: int, t: int, sequence_parallel: bool = True,
                          element: int = 2, groups: tuple[str, ...] = ("attention", "mlp")) -> float:
    """Bytes one layer keeps per micro-batch between its B and its W under a split backward (ZB-H1,
    :mod:`lightning_seqpar.tensor_parallel.weight_gradients`): what W reads of the projections whose weight gradient
    it computes (:attr:`ModelInventory.split_projections`). Their inputs, made in the forward: a group's column-parallel
    input once (the norm's output, an ``[s/t, b, h]`` shard under SP: W gathers it again), a row-parallel one's
    ``[s, b, in/t]``; and their output gradients, made in B: a column-parallel one's ``[s, b, out/t]``, a row-parallel
    one's ``[s, b, h]`` (gathered). Fully trained, these are ``[s, b, (a + 2g)·d/t]``, ``[s, b, h]`` twice and
    ``[s, b, f/t]`` (twice gated) beside the inputs. A LoRA adapter (its base frozen: nothing of the base waits) holds
    the same for its projection, plus its rank-r tensors: ``lora_A``'s output gradient (``[s/t, b, r]`` on a column
    input under SP) and ``lora_B``'s input ``[s, b, r]``; with LoRA dropout each adapter's input is its own.

    A mixture of experts (:mod:`lightning_seqpar.moe.expert_product`) whose experts train keeps its experts' rows: on
    average ``s·b·k/t`` per rank (its tokens' k choices; what a rank receives varies with the routing), each with its
    input ``h`` and inner ``f_e`` and their gradients ``2f_e`` and ``h``; a shared expert keeps a dense MLP's terms of
    its width. ``groups``: the part's projections counted (``("mlp",)``: the MLP's and the experts' alone)."""
    split = t if sequence_parallel and t > 1 else 1
    h = inventory.hidden_size
    training = inventory.training
    own_inputs = training is not None and getattr(training.lora, "lora_dropout", 0.0)  # each adapter drops its own
    terms = 0.0
    for group in groups:
        columns = [p for p in inventory.split_projections if p.group == group and p.kind == "column"]
        if columns:
            terms += h / split * ((sum(1 for p in columns if p.rank) or 1) if own_inputs else 1)
        for p in inventory.split_projections:
            if p.group != group:
                continue
            if p.kind == "column":
                terms += p.width / t + (p.rank / split + p.rank if p.rank else 0)
            else:
                terms += p.width / t + h + 2 * p.rank
    experts = inventory.experts
    if "mlp" in groups and experts is not None and any(e.deferred and e.expert for e in inventory.entries):
        k, width = experts.top_k, experts.expert_ffn
        terms += k * (h + width) / t + k * (2 * width + h) / t
        if experts.shared_ffn:
            dense = experts.shared_ffn
            terms += h / split + dense / t + h + (2 if inventory.gated_mlp else 1) * dense / t
    return element * s * b * terms


def offloaded_layer_bytes(inventory: ModelInventory, s: int, b: int, t: int, sequence_parallel: bool = True,
                          recompute: str = "selective", element: int = 2, dropout: bool = False,
                          modules: tuple[str, ...] = (), offload: tuple[str, ...] = ()) -> float:
    """Bytes ``offload``'s modules copy to the host per layer and micro-batch (and back in backward): the terms of
    :func:`layer_bytes` they name (the norms' inputs, the projections' inputs, q/k/v and core attention, the MLP's
    inner activations); nothing under full recomputation."""
    terms = _layer_terms(inventory, s, b, t, sequence_parallel, recompute, element, dropout, modules)
    return sum(v for k, v in terms.items() if k in offload)


def _layer_terms(inventory: ModelInventory, s: int, b: int, t: int, sequence_parallel: bool, recompute: str,
                 element: int, dropout: bool, modules: tuple[str, ...]) -> dict[str, float]:
    """The layer's bytes by the module that saves them (:data:`~lightning_seqpar.offload.OFFLOAD_MODULES` names;
    ``kept``: what no module offloads, the residual dropouts' masks, or the layer input under full recomputation)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}.")
    split = t if sequence_parallel and t > 1 else 1
    h, a, g, d, f = (inventory.hidden_size, inventory.num_heads, inventory.num_kv_heads, inventory.head_dim,
                     inventory.ffn_hidden_size)
    sbh = element * s * b * h / split
    if recompute == "full" or "full" in modules:
        return {"kept": sbh}
    core = 0.0
    if recompute == "none" and "core_attn" not in modules and inventory.eager_attention:
        core = element * a * s * s * b / t
        if inventory.attention_dropout > 0:
            core += (1 + element) * a * s * s * b / t
    inner = 0.0 if "mlp" in modules or "moe" in modules else (3 if inventory.gated_mlp else 2) * element * s * b * f / t
    rebuilt = "layernorm" in modules  # the norms' outputs (the projections' inputs) made again in backward
    kept_input = "mlp" in modules or "moe" in modules  # a recomputed MLP keeps its input itself
    return {"attn_norm": sbh, "qkv_linear": 0.0 if rebuilt else sbh,
            "core_attn": (a * d + 2 * g * d) * element * s * b / t + core,
            "attn_proj": a * d * element * s * b / t, "mlp_norm": sbh,
            "mlp": (0.0 if rebuilt and not kept_input else sbh) + inner,
            "kept": 2 * s * b * h / split if dropout else 0.0}


def outside_layers_bytes(inventory: ModelInventory, s: int, b: int, t: int, last: bool,
                         sequence_parallel: bool = True, element: int = 2) -> float:
    """The last rank's final norm (the stack's gathered ``[b, s, h]`` output: a float32 copy and the normed output)
    and the loss's float32 logits and their softmax, ``[b·s, v/t]`` each, for one micro-batch (bytes; measured on a
    Hugging Face Llama at tp 2: the norm's and the loss's tensors are these)."""
    if not last:
        return 0.0
    padded = padded_size(inventory.vocab_size, t)
    return (4 + element) * s * b * inventory.hidden_size + 8 * s * b * padded / t
