"""Model-state bytes of one rank: parameters, gradients, main params and optimizer state, as the strategy holds them.

Per element of the parameters a rank holds (:func:`held_entries`):

=============  =====================  ==========================================================================
precision      parameters, gradients  AdamW state (``exp_avg``, ``exp_avg_sq``) and main params
=============  =====================  ==========================================================================
``32-true``    4 + 4                  2 × 4
``bf16-mixed`` 4 + 4                  2 × 4 (the parameters are float32; autocast computes in bfloat16)
``bf16-true``  2 + 2                  2 × 2; under ``zero=1`` with ``main_params`` a float32 main copy (4) and
                                      its state 2 × 4
``64-true``    8 + 8                  2 × 8
=============  =====================  ==========================================================================

Under ``zero=1`` (Megatron's distributed optimizer) the state and main params cover the rank's element range of each
parameter, ``ceil(n / d)`` elements (the last ranges shorter). Gradients are reduced in float32 for 16-bit parameters
(``r = max(4, bytes per element)``):

- ``zero=0``, ``d = 1``: each parameter's ``.grad``;
- ``zero=0``, ``d > 1``: the all-reduce buckets, ``n·r`` per parameter, which the ``.grad`` of a parameter of that
  dtype is a view of (a 16-bit ``.grad`` is kept beside them);
- ``zero=1``: the reduce-scatter buckets, ``d·ceil(n / d)·r`` per parameter, and the reduced range kept for the
  update, ``ceil(n / d)·r`` (with ``d = 1`` the bucket itself, counted once); no ``.grad`` after the step.

Under expert parallelism (``ep = e``) an expert weight is held ``numel / e`` per rank whatever t is (``numel / (e·etp)``
where expert tensor parallelism splits its width too, ``expert_tp = etp``), and its data replicas are the expert
data-parallel group of ``edp = t·d / (e·etp)`` ranks (Megatron's "MoE parallel folding"): under ``zero=1`` its ranges are ``ceil(n / edp)``, owned by the rank's expert data-parallel
index, so tensor-parallel peers hold different amounts; under ``zero=0`` gradient buckets exist as soon as ``d > 1`` or
``edp > 1`` (every trainable parameter then has one, a dense one over its group of one rank when ``d = 1``).

Frozen parameters (``requires_grad=False``: LoRA's base) count as parameters only: no gradient, no bucket, no main
param, no optimizer state (a frozen bf16 parameter costs its 2 bytes).

AdamW (and Adam) also keeps a float32 ``step`` per parameter (4 bytes); SGD with momentum keeps one state
(``momentum_buffer``) and no step (:data:`OPTIMIZER_STATES`); Muon (``lightning_seqpar.optim.Muon``) its momentum on
the layers' matrices and AdamW's states on the rest (under ``zero=1`` on the owned ranges too). Bytes, exact: equal to
what each rank holds after a step (``tests/plan/test_state_bytes.py``, AdamW and Muon; ``tests/plan/test_planner.py``,
SGD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.pipeline_parallel.layout import StagePlacement, StageLayout
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory, ParameterEntry

PARAMETER_BYTES = {"32-true": 4, "bf16-mixed": 4, "bf16-true": 2, "64-true": 8}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "muon": 1}
"""state tensors per parameter element: ``exp_avg`` and ``exp_avg_sq``; SGD's ``momentum_buffer``; Muon's
``momentum_buffer`` on its matrices (:func:`is_muon_matrix`; AdamW's two, and a step, on the rest)"""
STEP_BYTES = 4
MUON_BUFFERS = 4
"""bfloat16 copies of this rank's Muon matrix elements its orthogonalisation holds at once, an estimate: the pieces
sent to the owners, the assembled matrices and their results on the owner, the pieces sent back
(:func:`~lightning_seqpar.optim.matrix_owners.process_whole`; each rank owns about 1/t of the matrices)"""


def is_muon_matrix(entry: ParameterEntry) -> bool:
    """Whether ``lightning_seqpar.optim.Muon`` (``optim.name=muon``) orthogonalises ``entry``: a matrix (two dims or
    more) of a decoder layer (the embeddings and the head are AdamW's:
    :meth:`~lightning_seqpar.optim.Muon.matrices`)."""
    return entry.part == "layer" and len(entry.shape) >= 2


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank (see the module docstring)."""

    parameters: int
    gradients: int
    main_params: int
    optimizer: int
    steps: int = 0
    """of ``optimizer``: AdamW's float32 ``step`` counters"""
    temporary: int = 0
    """what the optimizer's multi-tensor step makes for a moment (AdamW: ``exp_avg_sq.sqrt()``, one state's size;
    SGD with momentum: nothing)"""
    bucketed: bool = False
    """the gradients live in reduction buckets (``d > 1``, ``edp > 1`` with experts held, or ``zero=1``), not in
    ``.grad`` alone"""
    trained: int = 0
    """of ``parameters``: the trainable ones' (those that get a ``.grad``; LoRA's adapters, not its frozen base)"""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.main_params + self.optimizer

    @property
    def floor(self) -> int:
        """Bytes no step of this rank peaks below: all of the state and the optimizer's temporary, which its step
        holds at once (the planner's peak is at least this)."""
        return self.total + self.temporary


def stage_layout(inventory: ModelInventory, pp: int, vpp: int = 1,
                 pipeline_split: Optional[Sequence[int]] = None, placement: StagePlacement = "loop") -> StageLayout:
    """The strategy's layers per virtual stage, placed on the ranks as ``placement`` says (:meth:`StageLayout.build`;
    raises its ``ValueError``)."""
    return StageLayout.build(inventory.num_layers, pp, vpp, pipeline_split, placement)


def held_entries(inventory: ModelInventory, layout: StageLayout, pipeline_rank: int) -> list[ParameterEntry]:
    """The parameters pipeline rank ``pipeline_rank`` holds: its stages' layers; the embedding on the first rank and
    the final norm and head on the last (a tied embedding on both); any other parameter everywhere. (Shared: not to
    be changed.)"""
    return inventory.derived(("held", layout, pipeline_rank), lambda: _held_entries(inventory, layout, pipeline_rank))


def trained_elements(inventory: ModelInventory, layout: StageLayout, pipeline_rank: int, tp: int, ep: int = 1,
                     expert_tp: int = 1) -> tuple[int, int]:
    """``(dense, expert)``: elements of the trained parameters pipeline rank ``pipeline_rank`` holds on one rank of
    ``tp`` tensor-parallel, ``ep`` expert-parallel and ``expert_tp`` expert tensor-parallel ranks (what its optimizer
    updates and its gradients reduce, before ZeRO's ranges), the dense ones and the experts' apart."""
    def count() -> tuple[int, int]:
        held = [e for e in held_entries(inventory, layout, pipeline_rank) if e.trainable]
        return (sum(e.local_numel(tp, ep, expert_tp) for e in held if not e.expert),
                sum(e.local_numel(tp, ep, expert_tp) for e in held if e.expert))

    return inventory.derived(("trained elements", layout, pipeline_rank, tp, ep, expert_tp), count)


def _held_entries(inventory: ModelInventory, layout: StageLayout, pipeline_rank: int) -> list[ParameterEntry]:
    layers = {i for stage in layout.stages_of(pipeline_rank) for i in range(*layout.bounds(stage))}
    first = pipeline_rank == layout.rank_of(0)
    last = pipeline_rank == layout.rank_of(layout.num_stages - 1)

    def held(entry: ParameterEntry) -> bool:
        if entry.part == "layer":
            return entry.layer in layers
        if entry.part == "embedding":
            return first or (entry.tied and last)
        if entry.part in ("head", "final"):
            return last
        return True

    return [e for e in inventory.entries if held(e)]


def _muon_state(trained: Sequence[ParameterEntry], counts: Sequence[int], width: int, matrices: int
                ) -> tuple[int, int, int]:
    """Muon's ``(state bytes, of them the steps, the step's transient)`` over ``counts`` elements of each of
    ``trained`` of ``width`` bytes: momentum on its matrices, AdamW's two states and a step on the rest; AdamW one
    tensor at a time (its largest sqrt) and the orthogonalisation's bfloat16 buffers over ``matrices`` elements."""
    orthogonalised = sum(k for k, e in zip(counts, trained) if is_muon_matrix(e))
    aux = [k for k, e in zip(counts, trained) if not is_muon_matrix(e)]
    steps = STEP_BYTES * len(aux)
    return ((orthogonalised + 2 * sum(aux)) * width + steps, steps,
            max(aux, default=0) * width + MUON_BUFFERS * 2 * matrices)


def state_bytes(inventory: ModelInventory, tp: int, pp: int = 1, dp: int = 1, *, pipeline_rank: int = 0,
                data_rank: int = 0, vpp: int = 1, zero: int = 0, precision: str = "bf16-mixed",
                main_params: bool = False, pipeline_split: Optional[Sequence[int]] = None,
                optimizer: str = "adamw", ep: int = 1, expert_data_rank: int = 0,
                placement: StagePlacement = "loop", expert_tp: int = 1) -> StateBytes:
    """Model-state bytes of the rank at ``(pipeline_rank, data_rank)``, and ``expert_data_rank`` in its expert
    data-parallel group of ``t·d / (ep·expert_tp)`` ranks (without experts every tensor-parallel rank holds as much);
    the stages placed as ``placement`` says (``"V"``: ZB-V's and DualPipeV's, the embedding and the head both on rank 0).

    Raises:
        ValueError: an unknown precision or optimizer, a pipeline split the strategy refuses, or ``ep·expert_tp`` not
            dividing ``t·d`` (the expert grid must fold over the dense one).
    """
    split = tuple(pipeline_split) if pipeline_split is not None else None
    return inventory.derived(
        ("state", tp, pp, dp, pipeline_rank, data_rank, vpp, zero, precision, main_params, split, optimizer, ep,
         expert_data_rank, placement, expert_tp),
        lambda: _state_bytes(inventory, tp, pp, dp, pipeline_rank, data_rank, vpp, zero, precision, main_params, split,
                             optimizer, ep, expert_data_rank, placement, expert_tp))


def _state_bytes(inventory: ModelInventory, tp: int, pp: int, dp: int, pipeline_rank: int, data_rank: int, vpp: int,
                 zero: int, precision: str, main_params: bool, pipeline_split: Optional[Sequence[int]],
                 optimizer: str, ep: int, expert_data_rank: int, placement: StagePlacement,
                 expert_tp: int) -> StateBytes:
    if (tp * dp) % (ep * expert_tp):
        raise ValueError(f"ep·expert_tp = {ep}·{expert_tp} does not divide tp·dp = {tp}·{dp}: the expert grid folds "
                         f"over the dense one.")
    if precision not in PARAMETER_BYTES:
        raise ValueError(f"precision={precision!r}: one of {sorted(PARAMETER_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: one of {sorted(OPTIMIZER_STATES)} (sgd: with momentum).")
    states, adam = OPTIMIZER_STATES[optimizer], optimizer.startswith("adam")
    element = PARAMETER_BYTES[precision]
    reduced = max(4, element)
    held = held_entries(inventory, stage_layout(inventory, pp, vpp, pipeline_split, placement), pipeline_rank)
    parameters = sum(e.local_numel(tp, ep, expert_tp) for e in held) * element
    edp = tp * dp // (ep * expert_tp)
    # (elements on this rank, its replica group's size, this rank's index in it) of each trainable parameter: a
    # frozen one has no gradient and no state
    local = [(e.local_numel(tp, ep, expert_tp), *((edp, expert_data_rank) if e.expert else (dp, data_rank)))
             for e in held if e.trainable]
    total = sum(n for n, _, _ in local)
    trained = [e for e in held if e.trainable]  # (in the order of local)
    matrices = sum(n for (n, _, _), e in zip(local, trained) if is_muon_matrix(e))
    steps = STEP_BYTES * len(local) if adam else 0
    if zero == 0:
        bucketed = dp > 1 or (edp > 1 and any(e.expert for e in held))
        gradients = total * reduced + (total * element if element < reduced else 0) if bucketed else total * element
        if optimizer == "muon":
            state, steps, temporary = _muon_state(trained, [n for n, _, _ in local], element, matrices)
            return StateBytes(parameters, gradients, 0, state, steps, temporary, bucketed, total * element)
        return StateBytes(parameters, gradients, 0, states * total * element + steps, steps,
                          total * element if adam else 0, bucketed, total * element)
    ranges = [stop - start for start, stop in (owned_range(n, d, r) for n, d, r in local)]
    owned = sum(ranges)
    main = 4 if main_params and element < 4 else 0
    # d = 1: the reduced range is the bucket itself
    gradients = sum((d + 1 if d > 1 else 1) * -(-n // d) for n, d, _ in local) * reduced
    if optimizer == "muon":  # on the owned ranges; each rank orthogonalises about 1/d of the matrices
        state, steps, temporary = _muon_state(trained, ranges, main or element, matrices // max(1, dp))
        return StateBytes(parameters, gradients, owned * main, state, steps, temporary, True, total * element)
    return StateBytes(parameters, gradients, owned * main, states * owned * (main or element) + steps, steps,
                      owned * (main or element) if adam else 0, True, total * element)
