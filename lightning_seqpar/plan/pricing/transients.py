"""What a training step holds only for a moment at its peak, above the model state and the kept activations (bytes).

A rank's step peaks either in a backward, when the most micro-batches are in flight, or in the optimizer's step:

- **the loss's forward** (the last pipeline rank): the head's logits beside every kept activation, with their float32
  copy when 16-bit, and the softmax the loss keeps (:func:`loss_bytes`);
- **backward through the loss** (the last pipeline rank): the float32 gradient of the logits beside the kept
  softmax, ``4 · b·s·v/t`` (two of them at t = 1, torch's ``nll_loss`` and ``log_softmax`` backward); then, the
  softmax freed and the logits' gradient in its place, the gradient of the head's input ``e·b·s·h`` or, when the
  gradients accumulate (every micro-batch of a step but the first), the head's weight gradient before it is added
  to ``.grad``, ``r · v/t · h``; then the final norm's backward over the gathered sequence, four float32
  ``[s, b, h]`` temporaries beside the gradient of its output;
- **backward through a layer**: the input gathered again over the sequence for a weight gradient (§4.2.2, ``e·s·b·h``
  under sequence parallelism) or, accumulating, the largest weight gradient of the layer before it is added
  (``r · h·f/t`` for an MLP matrix; gate and up together, ``2·r · h·f/t``, in a gated MLP, whose input gradient
  they share; a mixture's packed gate and up projections of its ``E/e`` experts, ``r · E/e · 2f·h``, once; under
  ``bf16-mixed`` autocast's 16-bit gradient and its float32 copy, ``r = 2 + 4``) or, inside a dense MLP's
  backward, the gradients of its inner activations beyond the layer's own (``e·s·b·h/t + 3·e·s·b·f/t`` for a gated
  MLP: its down projection's input, ``act`` and ``up``; ``2·e·s·b·f/t`` ungated; less ``2·e·s·b·h/t``), whichever is
  largest: they make the peak where the MLP is frozen (LoRA) and no weight gradient stands in for them; or, where a
  recomputed mixture runs its forward again, its combine's moment: the experts' outputs ``[R, h]``, their copy in
  the pairs' order and the pairs' outputs ``[N, h]`` twice (sent back, then gathered per token), ``2·e·(R + N)·h``
  with ``N = R = s·b/t·k·etp`` (balanced routing); the incoming
  and outgoing gradient of the layer's output ``2·e·s·b·h / t``; under recomputation, what the layer's backward makes
  again beside them (one layer's kept bytes without recomputation, less those with it, for one micro-batch); or,
  larger at long sequences, the explicit core attention's backward over its ``b·(a/t)·s²`` scores
  (:func:`attention_backward_bytes`);
- **gradients accumulated beside the buckets**: with m > 1 micro-batches (a pipeline schedule's or gradient
  accumulation's) the ``.grad`` of the earlier ones is kept apart from the data-parallel buckets until the last
  backward fills them (one gradient per parameter, ``r`` bytes each, where the buckets are not already the
  ``.grad`` of a 16-bit parameter);
- **the end of a forward** (without a pipeline): Lightning's automatic optimization calls ``zero_grad`` after
  ``training_step``, so the last step's ``.grad`` is still alive while the forward keeps every layer's activations,
  and the explicit core attention of the last layer makes its ``b·(a/t)·s²`` temporaries beside them: the scores and
  their scaled copy, then the softmax's input, its float32 upcast under ``bf16-mixed`` (CUDA autocast's rule) and
  its output (:func:`forward_transient_bytes`). Measured on an H100 (Llama-3-8B, tp 8, s 8192, bf16-mixed,
  selective): this moment is the step's peak, 27.73 GB against 25.68 GB in the backward and 20.15 GB in the
  optimizer's step;
- **the optimizer**: AdamW's multi-tensor step (torch's default on CUDA) makes one temporary the size of its
  second-moment state (``exp_avg_sq.sqrt()``) before the update (:attr:`~.state.StateBytes.temporary`).

(``e`` bytes per activation element, ``r`` per parameter element.) Calibrated with the kept bytes against the peak a
tracker measures over whole training steps: ``tests/plan/test_step_calibration.py``.
"""

from __future__ import annotations

from typing import Optional

from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.parallel.split_sizes import padded_size


def largest_layer_weight(inventory: ModelInventory, t: int, ep: int = 1, expert_tp: int = 1) -> int:
    """Elements of the largest weight gradient a layer's backward makes at once (of a trained parameter: a frozen
    one makes none), on one rank of ``t``
    tensor-parallel, ``ep`` expert-parallel and ``expert_tp`` expert tensor-parallel ranks: a dense parameter's, twice
    over in a gated MLP (gate and up share their input's gradient); a mixture's packed ``gate_up_proj``
    ``[E/e, 2f/etp, h]`` once (one grouped GEMM's gradient holds both)."""
    factor = 2 if inventory.gated_mlp else 1
    return inventory.derived(("largest layer weight", t, ep, expert_tp), lambda: max(
        (e.local_numel(t, ep, expert_tp) * (1 if e.expert else factor)
         for e in inventory.entries if e.part == "layer" and e.trainable), default=0))


def backward_transient_bytes(inventory: ModelInventory, s: int, b: int, t: int, element: int, parameter: int,
                             last: bool, accumulating: bool, recomputed: float = 0.0,
                             sequence_parallel: bool = True, largest: Optional[int] = None,
                             freed: float = 0.0, loss: Optional[float] = None, expert_tp: int = 1) -> float:
    """The larger of a backward's moments through the loss (``last`` rank only) and through a layer (see the module
    docstring), for a micro-batch of ``b`` sequences of ``s`` tokens on one tensor-parallel rank of ``t``;
    ``recomputed``: the bytes a layer's backward makes again (recomputation); ``largest``:
    :func:`largest_layer_weight` (computed when not given); ``freed``: on the last rank, what the micro-batch kept
    after its layers (final norm, head, loss), gone once its backward reaches them; ``loss``: what the loss's
    backward makes (default: :func:`loss_bytes`' at t, the vocabulary-parallel loss where t > 1); ``expert_tp``: the
    mixture's expert tensor-parallel size (each pair sent to every slice of its expert)."""
    h = inventory.hidden_size
    sbh = s * b * h
    largest = largest_layer_weight(inventory, t) if largest is None else largest
    weight_gradients = largest * parameter if accumulating else 0
    gathered = element * sbh if sequence_parallel and t > 1 else 0
    inner = 0.0  # a dense MLP's inner gradients beyond the layer output's two (the module docstring)
    if inventory.experts is None:
        inner = element * sbh / t + (3 if inventory.gated_mlp else 2) * element * s * b * inventory.ffn_hidden_size / t
        inner -= 2 * element * sbh / t
    elif recomputed:  # the recomputed mixture's combine (the module docstring)
        pairs = s * b / t * inventory.experts.top_k * expert_tp
        inner = 4 * element * pairs * h
    layer = max(gathered, weight_gradients, inner) + recomputed + 2 * element * sbh / t
    if not last:
        return layer
    v = padded_size(inventory.vocab_size, t) // t
    head = parameter * v * h if accumulating and inventory.head_trained else element * sbh
    final_norm = 4 * 4 * sbh  # its backward's float32 temporaries over the gathered sequence
    # The loss's backward makes the logits' gradient beside the softmax it keeps; the head's backward then makes
    # its gradients once the loss freed the softmax, the logits' gradient taking the softmax's place.
    loss = loss_bytes(inventory, s, b, t, element, t > 1)[2] if loss is None else loss
    return max(layer - freed, loss, head, final_norm + element * sbh)


def loss_bytes(inventory: ModelInventory, s: int, b: int, t: int, element: int,
               vocab_parallel: bool = True) -> tuple[float, float, float]:
    """The loss's logits on the last rank, for a micro-batch (bytes): ``(logits, forward, backward)``.

    - ``logits``: the head's output ``[b·s, v/t]`` in the activations' dtype, alive from the head to the end of the
      loss's forward only (nothing saves it: the loss keeps its float32 softmax);
    - ``forward``: what the loss's forward makes beside the logits and the softmax it keeps: their float32 copy
      when the logits are 16-bit;
    - ``backward``: the float32 gradient of the logits beside the kept softmax: one ``[b·s, v/t]`` for the
      ``vocab_parallel`` loss (:mod:`lightning_seqpar.tensor_parallel.cross_entropy`: its softmax's copy), two for
      torch's (``nll_loss`` and ``log_softmax`` backward, each its own: a model not split over tp or cp)."""
    rows = s * b * (padded_size(inventory.vocab_size, t) // t)
    return element * rows, (4 * rows if element < 4 else 0.0), (4 if vocab_parallel else 8) * rows


def accumulation_bytes(parameter_bytes: int, num_microbatches: int, buckets: bool, grad_beside_buckets: bool) -> float:
    """``.grad`` kept apart from the buckets while micro-batches accumulate (see the module docstring): one gradient
    per parameter, in the parameters' dtype (``parameter_bytes`` on this rank)."""
    if num_microbatches == 1 or not buckets or grad_beside_buckets:
        return 0.0
    return float(parameter_bytes)


SCORE_TEMPORARIES = {  # precision: (forward, backward) bytes per score element, selective | full | kept
    "bf16-mixed": ((10.0, 12.0), (11.0, 13.0), (5.0, 6.0)),
    "bf16-true": ((10.0, 12.0), (10.5, 12.5), (4.5, 6.0)),
    "32-true": ((8.0, 12.0), (9.0, 13.0), (5.0, 8.0)),
}
"""The explicit core attention's temporaries, in bytes per element of its ``b·(a/t)·s²`` scores beyond what the
layer keeps, at the forward's moment and at the backward's, when the attention is recomputed (selective, full)
and when it keeps its probabilities (no recomputation: part of what would be temporary is kept instead).

The forward makes the scores and their scaled copy, the masked scores, then the softmax's float32 upcast and
output (float32 as CUDA autocast and Hugging Face's eager attention compute it) before the 16-bit probabilities;
the backward recomputes them where recomputed and adds the probabilities' gradient, its float32 upcast and the
scores' gradient. Measured with a live-tensor tracker over whole training steps with CUDA autocast's float32
softmax in force, where the ``s²`` terms dominate (s 1024; ``tests/plan/test_step_calibration.py``), rounded up.
Under selective recomputation the attention's checkpoint saves the prologue's ``[b, 1, s, s]`` mask, one per
micro-batch in flight: priced with the prologue (:func:`~..measuring.probe.fit_outside` under selective recomputation),
not here (its share, a byte per score element at 4 heads per rank, was in these figures while a pipeline stage's second
micro-batch's mask went unpriced: -6.6 % at pp 2, s 1024). The full recomputation's figures keep that share: a
whole layer's checkpoint keeps the mask too, but moving it to the prologue put a mixture with LoRA's step (s 32,
pp 1) over the bound (+5.7 %); on a pipeline, where several micro-batches keep theirs, the prologue is probed under
full recomputation as well (:func:`~.kept.outside_bytes`)."""


def _score_elements(inventory: ModelInventory, s: int, b: int, t: int) -> float:
    return float(b * (inventory.num_heads // t) * s * s)


def _score_bytes(precision: str, recompute: str, backward: bool) -> float:
    table = SCORE_TEMPORARIES.get(precision) or SCORE_TEMPORARIES["bf16-mixed" if "16" in precision else "32-true"]
    return table[{"selective": 0, "full": 1}.get(recompute, 2)][1 if backward else 0]


def forward_transient_bytes(inventory: ModelInventory, s: int, b: int, t: int, precision: str,
                            recompute: str = "selective") -> float:
    """The explicit core attention's temporaries in one layer's forward on one of ``t`` tensor-parallel ranks
    (bytes): :data:`SCORE_TEMPORARIES` per score element. ``0`` for a fused kernel (sdpa keeps no ``s²`` tensor)."""
    if not inventory.eager_attention:
        return 0.0
    return _score_bytes(precision, recompute, False) * _score_elements(inventory, s, b, t)


def attention_backward_bytes(inventory: ModelInventory, s: int, b: int, t: int, precision: str,
                             recompute: str = "selective") -> float:
    """The explicit core attention's temporaries in one layer's backward (bytes), as
    :func:`forward_transient_bytes`; ``0`` for a fused kernel."""
    if not inventory.eager_attention:
        return 0.0
    return _score_bytes(precision, recompute, True) * _score_elements(inventory, s, b, t)


CONTEXT_BLOCK_TEMPORARIES = {  # (cp_comm, precision): (forward, backward) bytes per element of one block's scores
    ("ring", "bf16-mixed"): (12.0, 18.5),
    ("ring", "bf16-true"): (12.0, 18.5),
    ("ring", "32-true"): (12.0, 13.0),
    ("all_to_all", "bf16-mixed"): (12.0, 13.5),
    ("all_to_all", "bf16-true"): (12.0, 13.5),
    ("all_to_all", "32-true"): (12.0, 11.5),
}
"""A context-parallel layer's core attention, computed block by block (:mod:`lightning_seqpar.context_parallel.blocks`):
bytes per element of one explicit block's ``b·(a/t)·n²`` scores (``n = s/(2c)``, a chunk) at the forward's moment
and at the backward's: the float32 scores, their masked copy and the block's probabilities; in backward the
recomputed probabilities, their gradient and the scores' gradient (more under 16-bit inputs, whose blocks are cast to
float32 first; more on the ring, whose backward holds the blocks of two sources at once). A fused kernel makes none. Measured with a live-tensor tracker over whole training steps at s 1024
(``tests/plan/test_step_calibration.py``), rounded up."""


def context_attention_kept(inventory: ModelInventory, s: int, b: int, t: int, c: int, element: int) -> float:
    """What a context-parallel layer's blockwise core attention keeps for backward beyond what its layer keeps at
    ``s/c`` tokens without the ``s²`` terms (bytes): its merged output ``[b, a/t, s/c, d]`` in the activations' dtype
    and the log-sum-exp ``[b, a/t, s/c]`` in float32 (:class:`~lightning_seqpar.context_parallel.attention`'s saved
    tensors)."""
    rows = b * (inventory.num_heads // t) * (s // c)
    return rows * inventory.head_dim * element + 4 * rows


def context_transient_bytes(inventory: ModelInventory, s: int, b: int, t: int, c: int, precision: str,
                            backward: bool, comm: str = "ring") -> float:
    """A context-parallel layer's core-attention temporaries at the forward's or the backward's moment (bytes): the
    float32 accumulators of the output and log-sum-exp over the rank's ``s/c`` queries (and in backward the
    gradients of q, k and v in float32, the key/value heads expanded), the key/value block in flight on the ring,
    and one block's :data:`CONTEXT_BLOCK_TEMPORARIES` when the blocks are explicit. ``comm="all_to_all"``: the
    rank attends ``a/(t·c)`` heads over the whole sequence, its blocks ``c`` times fewer heads."""
    heads, kv, d = inventory.num_heads // t, inventory.num_kv_heads // t, inventory.head_dim
    rows = b * heads * (s // c)
    accumulators = 4 * rows * (d + 1) + (4 * rows * d * 3 if backward else 0)
    element = 2 if "16" in precision else 4
    in_flight = 2 * b * kv * (s // c) * d * element * (2 if backward else 1)
    n = s // (2 * c)
    table = (CONTEXT_BLOCK_TEMPORARIES.get((comm, precision))
             or CONTEXT_BLOCK_TEMPORARIES[(comm, "bf16-mixed" if "16" in precision else "32-true")])
    block_heads = heads // c if comm == "all_to_all" else heads
    blocks = table[backward] * b * block_heads * n * n if inventory.eager_attention else 0.0
    return accumulators + in_flight + blocks
