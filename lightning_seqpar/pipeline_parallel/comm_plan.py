"""Which transfers each pipeline rank posts, in which batches, around its schedule's actions.

NCCL matches point-to-point messages between two ranks by the order they were posted, not by tag, and a
send of more than its internal buffer completes only once the matching receive is posted. Two neighbours
that each block in a send to the other (1F1B's steady state: rank r sends an activation forward while rank
r+1 sends a gradient back) wait forever. So the transfers are issued as Megatron-LM issues them: each rank
posts, between two of its actions, one batch (``torch.distributed.batch_isend_irecv``) holding the send of
what the last action produced and the receive of what the next action needs (``send_forward_recv_backward``,
``send_backward_recv_forward`` and their single forms). Both sides of every pair of matching transfers then
post them in the same order, and :mod:`~lightning_seqpar.pipeline_parallel.nccl_model` checks, under NCCL's
rules, that no schedule deadlocks and that every receive gets the message it expects.

In the V placement (ZB-V) one ordered pair of ranks carries two kinds of message (rank r sends rank r+1 the
activations of its first chunk and the gradients of its second), in an order that is not the one its peer needs
them in, and neighbours send each other gradients at the same time: there the transfers are posted in rounds of
a replay of the schedule (:func:`timed_program`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.schedules import (Action, ScheduleName, action_times, build_schedule,
                                                          interleaved_warmup)

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Transfer:
    """One send or receive of a pipeline rank.

    Attributes:
        send: a send (else a receive).
        kind: ``"activation"`` (forward) or ``"gradient"`` (backward).
        stage: the virtual stage that receives it.
        microbatch: the micro-batch it belongs to.
        peer: the pipeline rank on the other side.
    """

    send: bool
    kind: str
    stage: int
    microbatch: int
    peer: int
    header: bool = False

    @property
    def message(self) -> tuple[str, int, int]:
        """What is transferred, the same on both sides: ``(kind, receiving stage, micro-batch)``."""
        return self.kind, self.stage, self.microbatch


@dataclass(frozen=True)
class Batch:
    """Transfers posted together (one ``batch_isend_irecv``), in the program's order; the rank waits for all of them
    before the first action that needs one of its messages (the NCCL model, more strictly, at once)."""

    transfers: tuple[Transfer, ...]


Step = Union[Action, Batch]


def carries_header(transfer: Transfer, layout: Optional[StageLayout] = None) -> bool:
    """Whether ``transfer`` is preceded by a header in a step that exchanges shapes: every activation in the loop
    placement; in the V placement, where every stage boundary carries the shapes of the first stage's output
    (:class:`~lightning_seqpar.pipeline_parallel.p2p.StageTransport` ``one_shape``), only the first micro-batch's
    activation into each first-chunk stage, the first message between its two ranks."""
    if transfer.kind != ACTIVATION:
        return False
    return layout is None or layout.placement == "loop" or (transfer.stage < layout.pp and transfer.microbatch == 0)


def with_headers(program: list[Step], layout: Optional[StageLayout] = None) -> list[Step]:
    """The program of a step that exchanges shapes (:class:`~lightning_seqpar.pipeline_parallel.p2p.StageTransport`).

    Only activations carry a header (dtype and shape; which ones: :func:`carries_header`): a gradient has the shape
    and dtype of the activation its receiver sent. A batch that receives no header sends its activations with their
    headers in front. A batch that receives one becomes two: the first exchanges the headers (and the gradients), the
    second, posted once the shapes are read, the activations both ways. (Sending an activation in the first batch
    could wait on a peer that is itself waiting to read a header; receiving gradients in the second could wait on a
    peer that needs this rank's activation first: :mod:`~lightning_seqpar.pipeline_parallel.nccl_model` finds
    both.)"""
    out: list[Step] = []
    for step in program:
        if not isinstance(step, Batch):
            out.append(step)
            continue
        split = any(carries_header(t, layout) and not t.send for t in step.transfers)
        # Gradients, then headers, then activations: between two ranks both sides post in this order whether or
        # not their batch is split.
        gradients = [t for t in step.transfers if t.kind != ACTIVATION]
        activations = [t for t in step.transfers if t.kind == ACTIVATION]
        headers = [replace(t, header=True) for t in activations if carries_header(t, layout)]
        first, then = (gradients + headers, activations) if split else (gradients + headers + activations, [])
        out.append(Batch(tuple(first)))
        if then:
            out.append(Batch(tuple(then)))
    return out


def build_program(schedule: ScheduleName, num_microbatches: int, layout: StageLayout, rank: int,
                  forward_only: bool = False) -> list[Step]:
    """Pipeline rank ``rank``'s actions of ``schedule`` with its transfers (:func:`rank_program`). The interleaved
    schedule's steady state posts each forward-backward pair's transfers in one batch, as Megatron-LM does; 1F1B
    and GPipe post them around every action (Megatron-LM's ``send_forward_recv_backward`` and kin)."""
    if layout.placement == "V":
        lists = [build_schedule(schedule, num_microbatches, layout.pp, layout.virtual_stages, r, forward_only)
                 for r in range(layout.pp)]
        return timed_program(lists, layout, rank)
    actions = build_schedule(schedule, num_microbatches, layout.pp, layout.virtual_stages, rank, forward_only)
    pair_from = None
    if schedule == "interleaved_1F1B" and not forward_only:
        pair_from = interleaved_warmup(num_microbatches, layout.pp, layout.virtual_stages, rank)
    return rank_program(actions, layout, rank, pair_from)


def needs(action: Action, layout: StageLayout, rank: int) -> Optional[Transfer]:
    """The receive ``action`` waits for: an activation from the previous stage (a forward after the first stage),
    a gradient from the next one (a backward before the last stage); none where that stage is on this rank (the V
    placement's turn, handed over in memory by the executor)."""
    stage = layout.stage(rank, action.chunk)
    if action.kind == "F" and stage > 0 and layout.rank_of(stage - 1) != rank:
        return Transfer(False, ACTIVATION, stage, action.microbatch, layout.rank_of(stage - 1))
    if action.kind == "B" and stage < layout.num_stages - 1 and layout.rank_of(stage + 1) != rank:
        return Transfer(False, GRADIENT, stage, action.microbatch, layout.rank_of(stage + 1))
    return None


def produces(action: Action, layout: StageLayout, rank: int) -> Optional[Transfer]:
    """The send that follows ``action``: its output to the next stage (a forward before the last stage), its input's
    gradient to the previous one (a backward after the first stage); none where that stage is on this rank."""
    stage = layout.stage(rank, action.chunk)
    if action.kind == "F" and stage < layout.num_stages - 1 and layout.rank_of(stage + 1) != rank:
        return Transfer(True, ACTIVATION, stage + 1, action.microbatch, layout.rank_of(stage + 1))
    if action.kind == "B" and stage > 0 and layout.rank_of(stage - 1) != rank:
        return Transfer(True, GRADIENT, stage - 1, action.microbatch, layout.rank_of(stage - 1))
    return None


def _units(actions: list[Action], pair_from: Optional[int]) -> list[list[Action]]:
    """The schedule's actions cut into units: from index ``pair_from`` on (the steady state), a forward directly
    followed by a backward is one unit; every other action is a unit of its own."""
    units: list[list[Action]] = []
    index = 0
    while index < len(actions):
        pair = actions[index:index + 2]
        if pair_from is not None and index >= pair_from and len(pair) == 2 and pair[0].kind == "F" and pair[1].kind == "B":
            units.append(pair)
            index += 2
        else:
            units.append(pair[:1])
            index += 1
    return units


def rank_program(actions: list[Action], layout: StageLayout, rank: int, pair_from: Optional[int] = None) -> list[Step]:
    """``actions`` with the batches of transfers between them. The actions are cut into units (:func:`_units`):
    before each unit, one batch holds the sends of the previous unit's actions and the receives of this unit's
    (Megatron-LM's ``send_forward_backward_recv_forward_backward`` in the steady state, its single forms
    elsewhere); after the last unit, its sends. Empty batches are left out."""
    program: list[Step] = []
    sends: list[Transfer] = []
    for unit in _units(actions, pair_from):
        receives = [t for t in (needs(a, layout, rank) for a in unit) if t is not None]
        if sends or receives:
            program.append(Batch(tuple(sends + receives)))
        program.extend(unit)
        sends = [t for t in (produces(a, layout, rank) for a in unit) if t is not None]
    if sends:
        program.append(Batch(tuple(sends)))
    return program


def timed_program(lists: list[list[Action]], layout: StageLayout, rank: int) -> list[Step]:
    """Pipeline rank ``rank``'s actions of ``lists`` (every rank's, in the V placement) with its transfers posted in
    rounds.

    The lists are replayed under unit costs (:func:`~.schedules.action_times`); round T is the moment T. A message
    produced by an action that ends at T is sent, and received, in round T: each rank posts one batch per round it
    takes part in, holding every send of its action that ended then and every receive of a message its peers
    produced then, before its next action. Both sides of a pair of ranks then post the same messages in the same
    rounds and order (one action ends per rank per moment), and the rounds cannot wait on each other in a cycle:
    a round's batches need nothing but the same round's. A message may so arrive before its action needs it (held
    by the executor until then). Sending each message after the action that made it and receiving it before the
    action that needs it, as :func:`rank_program` does, deadlocks in the V: neighbours each send the other a
    gradient in a batch of its own (:mod:`~lightning_seqpar.pipeline_parallel.nccl_model` finds it)."""
    times = action_times(lists, layout.virtual_stages, layout.placement)
    rounds: dict[float, list[Transfer]] = {}
    for peer, peer_actions in enumerate(lists):
        for action, (_, end) in zip(peer_actions, times[peer]):
            sent = produces(action, layout, peer)
            if sent is None:
                continue
            if peer == rank:
                rounds.setdefault(end, []).append(sent)
            elif sent.peer == rank:
                rounds.setdefault(end, []).append(Transfer(False, sent.kind, sent.stage, sent.microbatch, peer))
    program: list[Step] = []
    due = sorted(rounds)
    for action, (start, _) in zip(lists[rank], times[rank]):
        while due and due[0] <= start:
            program.append(Batch(tuple(rounds[due.pop(0)])))
        program.append(action)
    program.extend(Batch(tuple(rounds[t])) for t in due)
    return program
