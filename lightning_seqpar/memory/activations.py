"""Activation bytes of a transformer layer and of a pipeline stage: Korthikanti et al. 2022, §4–§5.

Every figure is in **bytes** and counts what the forward pass keeps for the backward pass (Table 2):
16-bit activations (``bytes_per_element=2``) and 1-byte dropout masks by default; LayerNorm statistics
(2·sb elements per norm) are left out, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from lightning_seqpar.memory.conflicts import offload_conflict, recomputed_modules
from lightning_seqpar.memory.mixture import EXPERT_OFFLOAD_COPIES, EXPERT_OFFLOAD_TERMS, MixtureShape, mixture_terms

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of Table 1 (Korthikanti et al. 2022)."""

    s: int
    """sequence length (tokens)"""
    b: int
    """micro-batch size (sequences)"""
    h: int
    """hidden size"""
    a: int
    """attention heads"""
    L: int = 1
    """transformer layers"""
    v: int = 0
    """vocabulary size"""
    ffn_hidden_size: Optional[int] = None
    """MLP width f (default 4h, the paper's)"""
    num_kv_heads: Optional[int] = None
    """key/value heads g of grouped-query attention (default a: multi-head attention, the paper's)"""
    gated_mlp: bool = False
    """an MLP of three ``h × f`` matrices (SwiGLU: gate, up, down) instead of two"""

    @property
    def f(self) -> int:
        return self.ffn_hidden_size or 4 * self.h

    @property
    def g(self) -> int:
        """Key/value heads."""
        return self.num_kv_heads or self.a


# name: (attention/MLP block, counted once per element at full width, kind)
# kind "replicated": the LayerNorm/dropout/linear-input region TP leaves whole and SP splits over s.
# kind "tensor": inside the head- or feature-sharded region, always ÷t.  kind "core": selective recompute drops it.
def layer_activation_terms(
    shape: TransformerShape,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    bytes_per_element: int = 2,
    mask_bytes: int = 1,
    c: int = 1,
    modules: Sequence[str] = (),
    offload: Sequence[str] = (),
    norm_statistics_bytes: int = 0,
    experts: Optional[MixtureShape] = None,
) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward on one tensor-parallel rank (on the device), term by term.

    The terms are §4.1's (A1–A7 attention, M1–M4 MLP, the two LayerNorm inputs), generalised to an MLP
    of width f (the 4h→h terms scale with f/4h, as in Megatron-Core's ``theoretical_memory_usage``).
    Their sum is the matching row of Table 2:

    =====================  =========================================  ====================
    ``t``, SP, recompute   Table 2 row                                 sum (f = 4h)
    =====================  =========================================  ====================
    1, –, none             no parallelism (Eq. 1)                      sbh(34 + 5as/h)
    t, off, none           tensor parallel (Eq. 2)                     sbh(10 + 24/t + 5as/(ht))
    t, on, none            tensor + sequence parallel (Eq. 4)          sbh(34/t + 5as/(ht))
    t, off, selective      tensor parallel + selective                 sbh(10 + 24/t)
    t, on, selective       tensor + sequence parallel + selective      34·sbh/t
    any, off, full         full recomputation                          2·sbh
    =====================  =========================================  ====================

    Full recomputation keeps only the layer input: ``2sbh``, or ``2sbh/t`` under SP, where the input
    already is the local sequence shard ``[s/t, b, h]`` (no extra all-gather is needed, unlike the
    ``--distribute-saved-activations`` the paper sets aside for TP alone).

    With context parallelism (``c > 1``) every term is of the rank's ``s/c`` tokens, and core attention runs block by
    block (:mod:`lightning_seqpar.context_parallel`): instead of the ``5as²b/t`` terms it keeps its output and the
    float32 log-sum-exp of each query, ``e·sbh/(tc) + 4·asb/(tc)`` (full recomputation: the layer input ÷ c). Under SP the layer
    then keeps ``(34 + 2)·sbh/(tc) + 4asb/(tc)`` with 16-bit activations: Table 2's selective row divided by c, plus the
    kernel's output (``e·sbh/(tc)``) and log-sum-exp.

    Args:
        shape: s, b, h, a, f (L and v are not used).
        t: tensor-parallel size.
        c: context-parallel size.
        sequence_parallel: LayerNorm/dropout regions split along s (§4.2.2).
        recompute: ``"none"``, ``"selective"`` (core attention, §5) or ``"full"``.
        bytes_per_element: activation bytes (2 for 16-bit).
        mask_bytes: dropout-mask bytes per element (1).
        modules: recomputation by module beyond ``recompute`` (:data:`~lightning_seqpar.recompute.RECOMPUTE_MODULES`):
            ``"mlp"`` keeps the MLP's input and drops its inner terms, ``"layernorm"`` drops the norms' outputs (the
            projections' inputs; ``"core_attn"`` is ``recompute="selective"``).
        offload: modules whose saved tensors wait in host memory (:data:`~lightning_seqpar.offload.OFFLOAD_MODULES`):
            their terms (:data:`OFFLOAD_TERMS`) leave the device; :func:`offloaded_activation_terms` lists them.
        norm_statistics_bytes: bytes per element of the two statistics each LayerNorm saves (mean, rstd ``[s, b]``:
            the element size of the activations on CPU, 4 on CUDA); 0 leaves them out, as the paper does.
        experts: a mixture of experts in the MLP's place (:mod:`lightning_seqpar.memory.mixture`): its terms replace
            the MLP's inner ones, the norm's output is the router's input, ``modules`` may name ``"moe_act"`` and
            ``"moe"`` and ``offload`` ``"expert_fc1"`` and ``"moe_act"``.

    Raises:
        ValueError: ``t < 1``, an unknown ``recompute``, module or offloaded module, or a module both recomputed and
            offloaded (``core_attn`` under selective recomputation, ``mlp`` recomputed by module, the experts'
            modules under ``"moe"``, ``moe_act`` under ``"moe_act"``).
    """
    terms = _layer_terms(shape, t, sequence_parallel, recompute, bytes_per_element, mask_bytes, c, modules,
                         norm_statistics_bytes, experts)
    moved = _offloaded(terms, recompute, modules, offload, c, experts)
    return {name: value for name, value in terms.items() if name not in moved}


OFFLOAD_TERMS = {
    "attn_norm": ("LN1 input", "LN1 statistics"),
    "qkv_linear": ("QKV input (LN1 output)",),
    "core_attn": ("Q, K", "V", "softmax output", "softmax dropout mask", "softmax dropout output",
                  "attention output (blockwise kernel)", "log-sum-exp (float32)"),
    "attn_proj": ("projection input",),
    "mlp_norm": ("LN2 input", "LN2 statistics"),
    "mlp": ("fc1 input (LN2 output)", "GeLU input", "fc2 input (GeLU output)"),
}
"""The terms of :func:`layer_activation_terms` each offloaded module moves to host memory: what autograd saves while
it runs (:mod:`lightning_seqpar.offload`)."""


def offloaded_activation_terms(shape: TransformerShape, t: int = 1, sequence_parallel: bool = False,
                               recompute: Recompute = "none", bytes_per_element: int = 2, mask_bytes: int = 1,
                               c: int = 1, modules: Sequence[str] = (), offload: Sequence[str] = (),
                               norm_statistics_bytes: int = 0,
                               experts: Optional[MixtureShape] = None) -> dict[str, float]:
    """Bytes one layer's ``offload`` modules copy to host memory per micro-batch on one rank, term by term (and
    copy back in backward: the same bytes). Under full recomputation a layer keeps only its input: nothing moves.
    The arguments and errors are :func:`layer_activation_terms`'."""
    terms = _layer_terms(shape, t, sequence_parallel, recompute, bytes_per_element, mask_bytes, c, modules,
                         norm_statistics_bytes, experts)
    moved = _offloaded(terms, recompute, modules, offload, c, experts)
    if moved:
        moved |= {name for m in offload for name in EXPERT_OFFLOAD_COPIES.get(m, ())}
    return {name: value for name, value in terms.items() if name in moved}


def _offloaded(terms: dict[str, float], recompute: str, modules: Sequence[str], offload: Sequence[str],
               c: int, experts: Optional[MixtureShape]) -> set[str]:
    known = dict(OFFLOAD_TERMS)
    if experts is not None:  # a mixture has no dense MLP to offload, and its experts' modules instead
        del known["mlp"]
        known.update(EXPERT_OFFLOAD_TERMS)
    unknown = [m for m in offload if m not in known]
    if unknown:
        raise ValueError(f"offload={list(offload)!r}: {unknown} are not offloaded modules of this layer; they are "
                         f"{list(known)}.")
    if recompute == "full":
        return set()
    conflict = offload_conflict(offload, recomputed_modules(recompute, modules, c))
    if conflict is not None:
        raise ValueError(f"offload={list(offload)!r}, modules={list(modules)!r}: {conflict.message(offload)}")
    return {name for m in offload for name in known[m] if name in terms}


def _layer_terms(shape: TransformerShape, t: int, sequence_parallel: bool, recompute: str, bytes_per_element: int,
                 mask_bytes: int, c: int, modules: Sequence[str], norm_statistics_bytes: int,
                 experts: Optional[MixtureShape] = None) -> dict[str, float]:
    if t < 1 or c < 1:
        raise ValueError(f"t and c must be >= 1, got t={t}, c={c}.")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}.")
    known = ("core_attn", "layernorm", "mlp", "full") if experts is None else ("core_attn", "layernorm", "moe_act",
                                                                             "moe", "full")
    if any(m not in known for m in modules):
        raise ValueError(f"modules={list(modules)!r}: the modules recomputed in this layer are {list(known)}"
                         f"{' (a mixture of experts)' if experts is not None else ''}.")
    if "full" in modules:
        recompute = "full"
    elif "core_attn" in modules:
        recompute = "selective"
    s, b, h, a, f = shape.s, shape.b, shape.h, shape.a, shape.f
    e, m = bytes_per_element, mask_bytes
    sbh = s * b * h
    split = t if sequence_parallel else 1  # SP divides the replicated region by t
    if recompute == "full":
        return {"layer input": e * sbh / (split * c)}
    mlp_input = "fc1 input (LN2 output)" if experts is None else "router input (LN2 output)"
    terms = {
        # replicated under TP (Eq. 2's 10·sbh), split along s under SP
        "LN1 input": e * sbh / split,
        "QKV input (LN1 output)": e * sbh / split,
        "attention dropout mask": m * sbh / split,
        "LN2 input": e * sbh / split,
        mlp_input: e * sbh / split,
        "MLP dropout mask": m * sbh / split,
        # head- and feature-sharded (Eq. 2's 24·sbh/t for f = 4h)
        "Q, K": 2 * e * sbh / t,
        "V": e * sbh / t,
        "projection input": e * sbh / t,
        "GeLU input": e * s * b * f / t,
        "fc2 input (GeLU output)": e * s * b * f / t,
        # core attention (5as²b/t): what selective recomputation drops
        "softmax output": e * a * s * s * b / t,
        "softmax dropout mask": m * a * s * s * b / t,
        "softmax dropout output": e * a * s * s * b / t,
    }
    if recompute == "selective" or c > 1:
        for name in CORE_ATTENTION_TERMS:
            del terms[name]
    if "mlp" in modules or experts is not None:  # a recomputed MLP keeps its input; a mixture has its own terms
        del terms["GeLU input"], terms["fc2 input (GeLU output)"]
    if "layernorm" in modules:  # the norms' outputs made again from their inputs (a recomputed MLP keeps its input)
        del terms["QKV input (LN1 output)"]
        if "mlp" not in modules and "moe" not in modules:
            del terms[mlp_input]
    if norm_statistics_bytes:
        for norm in ("LN1", "LN2"):
            terms[f"{norm} statistics"] = 2 * norm_statistics_bytes * s * b / split
    if c > 1:  # the rank's s/c tokens; the blockwise kernel's own output and log-sum-exp
        terms = {name: value / c for name, value in terms.items()}
        terms["attention output (blockwise kernel)"] = e * sbh / (t * c)
        terms["log-sum-exp (float32)"] = 4 * a * s * b / (t * c)
    if experts is not None:  # of the rank's s·b/(split·c) tokens
        terms.update(mixture_terms(experts, s * b / (split * c), h, e, modules))
    return terms


def context_parallel_buffer_bytes(shape: TransformerShape, t: int, c: int, comm: str = "ring",
                                  bytes_per_element: int = 2) -> dict[str, float]:
    """Bytes context-parallel attention holds while it runs, beyond what the layer keeps (one layer at a time).

    - ring: the key/value block being computed and the next one arriving, ``2 · 2·b·(g/t)·(s/c)·d`` elements; in
      backward also the travelling dK/dV (the same again);
    - all-to-all: q, k, v and the output of whole sequences of ``a/(tc)`` (``g/(tc)``) heads, the size of the local ones.

    Raises:
        ValueError: an unknown ``comm``.
    """
    s, b, d, e = shape.s, shape.b, shape.h // shape.a, bytes_per_element
    kv = 2 * b * (shape.g / t) * (s / c) * d * e  # K and V of one rank's tokens
    if comm == "ring":
        return {"K/V held and arriving": 2 * kv, "dK/dV travelling (backward)": 2 * kv}
    if comm == "all_to_all":
        return {"gathered q, k, v and output": kv + 2 * b * (shape.a / t) * (s / c) * d * e}
    raise ValueError(f"comm must be 'ring' or 'all_to_all', got {comm!r}.")


CORE_ATTENTION_TERMS = ("softmax output", "softmax dropout mask", "softmax dropout output")


def layer_activation_bytes(shape: TransformerShape, t: int = 1, sequence_parallel: bool = False,
                           recompute: Recompute = "none", bytes_per_element: int = 2, mask_bytes: int = 1,
                           c: int = 1) -> float:
    """Table 2: bytes of activations per transformer layer on one tensor- (and context-) parallel rank.

    The sum of :func:`layer_activation_terms` (see there for the rows, arguments and errors).
    """
    return sum(layer_activation_terms(shape, t, sequence_parallel, recompute, bytes_per_element, mask_bytes,
                                      c).values())


def interleave_factor(p: int, m: int = 1) -> float:
    """``1 + (p−1)/(p·m)``: the first stage's extra activations under the interleaved 1F1B schedule.

    ``m`` is the number of model chunks (virtual stages) per pipeline rank; ``m = 1`` is plain 1F1B,
    whose first stage holds exactly L layers' worth (factor 1). §4.2.3; Megatron-Core uses the same form.

    Raises:
        ValueError: ``p < 1`` or ``m < 1``.
    """
    if p < 1 or m < 1:
        raise ValueError(f"p and m must be >= 1, got p={p}, m={m}.")
    return 1.0 if m == 1 else 1 + (p - 1) / (p * m)


def extra_activation_bytes(shape: TransformerShape, t: int = 1, p: int = 1, sequence_parallel: bool = True,
                           bytes_per_element: int = 2, mask_bytes: int = 1) -> dict[str, float]:
    """§4.3's activations outside the layers, on the first pipeline stage, term by term (bytes).

    * embedding dropout mask for the p micro-batches in flight: ``sbhp/t`` (sequence parallel);
    * with ``p == 1`` only (the stage also holds the model's end): the final LayerNorm's input
      ``2sbh/t``, the output layer's input ``2sbh/t`` and the fp32 logits of the cross entropy ``4sbv/t``.

    Without sequence parallelism the first three are not divided by t (the logits stay vocab-parallel).
    """
    s, b, h, v = shape.s, shape.b, shape.h, shape.v
    split = t if sequence_parallel else 1
    terms = {"embedding dropout mask": mask_bytes * s * b * h * p / split}
    if p == 1:
        terms["final LN input"] = bytes_per_element * s * b * h / split
        terms["output layer input"] = bytes_per_element * s * b * h / split
        terms["fp32 logits"] = 4 * s * b * v / t
    return terms


def first_stage_activation_bytes(
    shape: TransformerShape,
    t: int = 1,
    p: int = 1,
    m: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    include_extra: bool = False,
    bytes_per_element: int = 2,
    mask_bytes: int = 1,
) -> float:
    """Activation bytes on the first pipeline stage under 1F1B (Eq. 5, Eq. 6 with selective recompute).

    The first stage holds p micro-batches of L/p layers, L layers' worth independent of p, times
    :func:`interleave_factor` ``(p, m)``; ``include_extra`` adds :func:`extra_activation_bytes`.
    """
    total = shape.L * layer_activation_bytes(shape, t, sequence_parallel, recompute, bytes_per_element, mask_bytes)
    total *= interleave_factor(p, m)
    if include_extra:
        total += sum(extra_activation_bytes(shape, t, p, sequence_parallel, bytes_per_element, mask_bytes).values())
    return total
