"""What one micro-batch of a layout keeps for backward, in bytes: a layer's activations, the first layer's saving
where parameters are frozen, and what the forward keeps outside the layers. Measured on small copies of the model and
scaled (the :class:`~.measurements.Measurements` handed in) where the model can be probed; Table 2's model
(:mod:`.activations`) where it cannot (``measured`` or the inventory's config ``None``).

Shapes: ``s`` is the global sequence length; a context-parallel rank's layers see ``s/c`` tokens (``local``).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_seqpar.pipeline_parallel.schedules import splits_backward
from lightning_seqpar.plan.pricing.activations import layer_bytes, outside_layers_bytes
from lightning_seqpar.plan.pricing.experts import expert_layer_elements, expert_tensor_parallel_bytes
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.layout_record import LayoutRecord
from lightning_seqpar.plan.pricing.measurements import Measurements
from lightning_seqpar.plan.pricing.state import PARAMETER_BYTES
from lightning_seqpar.plan.pricing.transients import context_attention_kept


def never_negative(term: str, value: float, record: LayoutRecord) -> float:
    """``value`` (bytes of a priced ``term``), at least 0.

    Raises:
        ArithmeticError: ``value`` is below 0 by more than a byte's rounding: a fit was read outside what it measured
            (it once priced LoRA's activations under bf16-mixed at -25 MB), a defect of the planner to report with the
            layout named, never an answer to give.
    """
    if value < -1.0:
        layout = f"{record.layout} dp {record.dp} mbs {record.micro_batch}"
        raise ArithmeticError(f"The planner priced {term} at {value / 1e6:.2f} MB for {layout}: a fit read past its "
                              f"probes. Please report it with the model's config.")
    return max(0.0, value)


def activation_element_bytes(precision: str) -> int:
    """Bytes of one activation element under Lightning's ``precision``: 2 for ``bf16-mixed`` and ``bf16-true``, else
    the parameters' (``32-true``: 4, ``64-true``: 8)."""
    return 2 if precision.startswith("bf16") else PARAMETER_BYTES[precision]


def layer_activation_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, dropout: bool,
                 measured: Optional[Measurements]) -> float:
    """One layer's activation bytes per micro-batch in flight (autocast's 16-bit weight copies included: the parallel
    layers cast inside their autograd functions, where autocast's cache does not apply, so every micro-batch's
    forward keeps its own); measured and scaled where the model can be probed."""
    element = activation_element_bytes(precision)
    cp, local, recompute = record.layout.cp, s // record.layout.cp, record.layout.recompute
    extra = 0.0
    if cp > 1 and recompute != "full":
        # Under context parallelism a rank's layer is the same layer over its s/c tokens but for its core attention,
        # blockwise: it keeps q, k and v (as a checkpointed explicit core attention keeps them; a fused kernel
        # keeps them too, with its output and log-sum-exp), its output and log-sum-exp, and no s² tensor.
        recompute = "selective" if inventory.eager_attention else "none"
        if inventory.eager_attention:
            extra = context_attention_kept(inventory, s, record.micro_batch, record.layout.tp, cp, element)
    if measured is None or inventory.config is None:
        extra += expert_tensor_parallel_bytes(inventory, record, local, element)
        return extra + layer_bytes(inventory, local, record.micro_batch, record.layout.tp, True, recompute, element,
                                   dropout, modules=record.layout.recompute_modules, offload=record.layout.offload)
    kept = extra + layer_fit(record, inventory, recompute, precision, measured).bytes(
        local, record.micro_batch, inventory.head_dim, inventory.ffn_hidden_size, quadratic=cp == 1)
    if precision == "bf16-mixed" and recompute != "full":
        # The probe's rank holds every expert (ep 1), and autocast's 16-bit copy of each is kept for backward; a rank
        # of ep e casts its E/e experts only, each 1/etp of its width under expert tensor parallelism.
        kept -= 2 * expert_layer_elements(inventory) * (1 - 1 / (record.layout.ep * record.layout.expert_tp))
    return never_negative("a layer's activations", kept + expert_tensor_parallel_bytes(inventory, record, local,
                                                                                             element), record)


def first_layer_apart(training: Any) -> bool:
    """Whether the first layer is fitted and priced apart from the others: where parameters are frozen
    (``training``, :class:`~lightning_seqpar.plan.measuring.trained.TrainedParts`), its input may need no gradient.
    Apart, it
    holds its own input (what its checkpoint keeps of it, else nothing) and the outside's fit leaves that out; else it
    is priced as a middle layer and the outside counts its input's ``[s, b, h]`` copy as the stage input."""
    return training is not None


def layers_split_backward(record: LayoutRecord) -> bool:
    """Whether ``record``'s layers run with their backward split into B and W (a pipeline under ZB-H1, ZB-V or
    DualPipeV): their linears then keep other tensors (:func:`~lightning_seqpar.plan.measuring.probe.measure`'s
    ``split``)."""
    return record.layout.pp > 1 and splits_backward(record.layout.schedule)


def cached_copy_bytes(inventory: ModelInventory, record: LayoutRecord, precision: str) -> int:
    """Bytes of one layer's autocast 16-bit weight copies that a split backward keeps for no micro-batch but that live
    in autocast's cache while a forward's region lasts (``bf16-mixed``, else 0): its column- and row-parallel
    weights' local shards (the split linears keep their float32 weights and cast them again in B)."""
    if precision != "bf16-mixed" or not layers_split_backward(record) or record.layout.recompute == "full":
        return 0
    layer = next((e.layer for e in inventory.entries if e.part == "layer"), None)
    return 2 * sum(e.numel // record.layout.tp for e in inventory.entries
                   if e.part == "layer" and e.layer == layer and e.split in ("column", "row") and len(e.shape) == 2)


def layer_fit(record: LayoutRecord, inventory: ModelInventory, recompute: str, precision: str,
              measured: Measurements) -> Any:
    """The measured fit of a layer under ``record`` with ``recompute`` (:meth:`Measurements.layer`)."""
    lay = record.layout
    return measured.layer(inventory, lay.tp, recompute, precision, lay.recompute_modules, lay.offload,
                          layers_split_backward(record))


def first_layer_saving(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str,
                        measured: Optional[Measurements]) -> float:
    """Bytes the model's first layer keeps less than the others per micro-batch, where parameters are frozen (LoRA:
    its input, the frozen embedding's output, needs no gradient: the fit's ``first``); below 0 where it keeps more
    (under full recomputation its checkpoint keeps the layers' ``[s, b, h]`` copy of its input); 0 without a probed
    fit.
    Context-parallel layers are priced as their cp 1 twin's (:func:`layer_activation_bytes`)."""
    if measured is None or inventory.config is None or record.layout.cp > 1:
        return 0.0
    fit = layer_fit(record, inventory, record.layout.recompute, precision, measured)
    return fit.first_layer_saving(s, record.micro_batch, inventory.head_dim, inventory.ffn_hidden_size)


def mlp_kept_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str,
                   measured: Optional[Measurements]) -> float:
    """Of a layer's bytes per micro-batch, its MLP's
    (:meth:`~lightning_seqpar.plan.measuring.probe.LayerFit.mlp_bytes`): gone
    when the layer's attention runs its backward; 0 without a probed fit. ``s``: the tokens a rank's layer sees."""
    if measured is None or inventory.config is None or record.layout.cp > 1:
        return 0.0
    fit = layer_fit(record, inventory, record.layout.recompute, precision, measured)
    return fit.mlp_bytes(s, record.micro_batch, inventory.head_dim, inventory.ffn_hidden_size)


def loss_chunk_positions(record: LayoutRecord, inventory: ModelInventory, local: int) -> Optional[int]:
    """The positions per chunk of the loss's logits where they are computed in chunks: a Hugging Face model (a
    config the planner probes) whose head is split over tp or cp ranks (its head and loss rewritten, the
    vocabulary-parallel loss), and more than ``loss_chunk`` positions per rank
    (:meth:`~lightning_seqpar.tensor_parallel.vocab_logits.VocabShardedLogits.over_chunks`); else ``None``."""
    chunk = record.layout.loss_chunk
    if chunk is None or local <= chunk or inventory.config is None or (record.layout.tp == 1 and record.layout.cp == 1):
        return None
    return chunk


def outside_bytes(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str, element: int,
                   measured: Optional[Measurements]) -> tuple[float, float]:
    """What a micro-batch's forward keeps outside the layers (embedding, prologue, final norm, head, loss), and of it
    the prologue every pipeline stage's forward makes again (attention mask, rotary tables, position ids): measured
    and scaled where the model can be probed (the analytic model has no prologue)."""
    if measured is None or inventory.config is None:
        local = s // record.layout.cp
        return outside_layers_bytes(inventory, local, record.micro_batch, record.layout.tp, True, True, element), 0.0
    # A recomputed attention's checkpoint (selective: the attention's, full: the layer's) keeps the prologue's
    # [b, 1, s, s] mask, one per micro-batch in flight (transients.py SCORE_TEMPORARIES); context-parallel attention
    # masks its blocks itself. Under full recomputation with one micro-batch in flight (pp 1) the full row of
    # SCORE_TEMPORARIES holds that one mask's share, as measured; on a pipeline every micro-batch in flight keeps
    # one (that row's share then counts one of them twice: a byte per score element at 4 heads per rank), so the
    # prologue is probed with the recomputation that keeps it.
    lay = record.layout
    kept_mask = lay.cp == 1 and (lay.recompute == "selective" or lay.recompute == "full" and lay.pp > 1)
    recompute = record.layout.recompute if kept_mask else "none"
    fit = measured.outside(inventory, record.layout.tp, precision, recompute)
    sizes = (s // record.layout.cp, record.micro_batch, inventory.head_dim, inventory.vocab_size)
    outside = never_negative("what the forward keeps outside the layers", fit.bytes(*sizes), record)
    return outside, min(outside, never_negative("the prologue", fit.prologue_bytes(*sizes), record))


def elementwise_work(record: LayoutRecord, inventory: ModelInventory, s: int, precision: str,
                     measured: Optional[Measurements]) -> Optional[tuple[float, float]]:
    """``(operators, bytes)`` of the element-wise work (:mod:`..measuring.work`) one rank of ``record`` runs per step:
    its
    ``L/p`` layers' and a ``1/p`` share of what runs outside the layers, for each of its ``m`` micro-batches of ``s/c``
    tokens (a context-parallel layer counted as its cp 1 twin's over those tokens but for an explicit attention's
    ``s²`` terms, plus its blockwise attention's work, :func:`~..measuring.work.fit_context_work`; a rank of ep holding
    all the experts' operators); ``None`` where the model cannot be probed (``measured`` or the inventory's config
    ``None``)."""
    if measured is None or inventory.config is None:
        return None
    split, lay = layers_split_backward(record), record.layout
    fit = measured.work(inventory, lay.tp, lay.recompute, precision, lay.recompute_modules, lay.offload, split)
    local, b = s // lay.cp, record.micro_batch
    layer_ops, layer_bytes = fit.layer(local, b, inventory.head_dim, inventory.ffn_hidden_size, quadratic=lay.cp == 1)
    if lay.cp > 1:  # the blockwise attention's merges and accumulators (and, op by op, its blocks' softmax)
        fused, tp = not inventory.eager_attention, lay.tp
        heads, kv_heads = inventory.num_heads // tp, max(1, inventory.num_kv_heads // tp)
        ops, moved = measured.context_work(lay.cp, lay.cp_comm, heads, kv_heads, inventory.head_dim, precision,
                                           fused).layer(local, b, full=lay.recompute == "full")
        layer_ops, layer_bytes = layer_ops + ops, layer_bytes + moved
    rest_ops, rest_bytes = fit.rest(local, b, inventory.head_dim, inventory.vocab_size)
    layers, m = inventory.num_layers / lay.pp, lay.num_microbatches
    return m * (layers * layer_ops + rest_ops / lay.pp), m * (layers * layer_bytes + rest_bytes / lay.pp)
