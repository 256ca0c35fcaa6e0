"""A model of NCCL's point-to-point rules, to check the pipeline's transfer programs without a GPU.

The rules (NCCL's documentation on point-to-point communication and group calls):

* between an ordered pair of ranks there is one FIFO channel: the i-th send from a to b is received by the
  i-th receive posted on b from a, whatever tags say;
* a batch (``ncclGroupStart/End``, ``torch.distributed.batch_isend_irecv``) posts all its operations at
  once, and the rank goes on only when all of them have completed;
* a send completes only once its matching receive is posted (the worst case: beyond NCCL's buffer every
  message is a rendezvous), and a receive once its send is posted.

:func:`check_programs` runs every rank's program (:mod:`~lightning_seqpar.pipeline_parallel.comm_plan`) under
these rules and raises if the ranks deadlock or a receive would get another message than the one it expects.

The executor waits less than the model: it posts a batch and waits for it only when an action needs what it receives
(:mod:`~lightning_seqpar.pipeline_parallel.executor`). Posting order is the program's either way, and a program the
model runs to its end with a wait after every batch cannot deadlock with fewer waits: every wait left is one the
model's rank also made, no earlier.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from lightning_seqpar.pipeline_parallel.comm_plan import Batch, Step, Transfer


def _name(transfer: Transfer) -> str:
    return f"{'the header of ' if transfer.header else ''}{transfer.message}"


def _match(programs: Sequence[Sequence[Step]]) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """Pair every transfer ``(rank, step index, position in the batch)`` with its partner by FIFO order per
    ordered pair of ranks.

    Raises:
        RuntimeError: a receive would get another message, or a transfer has no partner.
    """
    sends: dict[tuple[int, int], list[tuple[tuple[int, int, int], Transfer]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[tuple[int, int, int], Transfer]]] = defaultdict(list)
    for rank, program in enumerate(programs):
        for index, step in enumerate(program):
            if isinstance(step, Batch):
                for position, t in enumerate(step.transfers):
                    (sends[(rank, t.peer)] if t.send else recvs[(t.peer, rank)]).append(((rank, index, position), t))
    partner = {}
    for channel in set(sends) | set(recvs):
        out, into = sends[channel], recvs[channel]
        if len(out) != len(into):
            raise RuntimeError(f"Ranks {channel[0]} -> {channel[1]}: {len(out)} sends but {len(into)} receives.")
        for (sender, sent), (receiver, expected) in zip(out, into):
            if (sent.message, sent.header) != (expected.message, expected.header):
                raise RuntimeError(f"Rank {channel[1]} expects {_name(expected)} from rank {channel[0]} but, matched "
                                   f"by order, receives {_name(sent)}.")
            partner[sender], partner[receiver] = receiver, sender
    return partner


def check_programs(programs: Sequence[Sequence[Step]]) -> int:
    """Run ``programs`` (one per pipeline rank) under NCCL's rules; return the number of rounds until all finish.

    Raises:
        RuntimeError: a receive matched by order with another message, an unmatched transfer, or a deadlock
            (naming each rank's blocked batch).
    """
    partner = _match(programs)
    position = [0] * len(programs)
    done: set[tuple[int, int, int]] = set()
    rounds = 0
    while True:
        for rank, program in enumerate(programs):  # actions are local: run up to the next batch
            while position[rank] < len(program) and not isinstance(program[position[rank]], Batch):
                position[rank] += 1
        if all(p == len(prog) for p, prog in zip(position, programs)):
            return rounds
        rounds += 1
        posted = {(rank, position[rank]) for rank, program in enumerate(programs) if position[rank] < len(program)}
        progressed = False
        for rank, program in enumerate(programs):
            if position[rank] == len(program):
                continue
            batch = program[position[rank]]
            for pos in range(len(batch.transfers)):
                op = (rank, position[rank], pos)
                if op not in done and partner[op][:2] in posted:
                    done.update((op, partner[op]))
                    progressed = True
        for rank, program in enumerate(programs):
            if position[rank] < len(program) and all((rank, position[rank], pos) in done
                                                     for pos in range(len(program[position[rank]].transfers))):
                position[rank] += 1
                progressed = True
        if not progressed:
            blocked = {rank: program[position[rank]] for rank, program in enumerate(programs)
                       if position[rank] < len(program)}
            raise RuntimeError(f"The pipeline's transfers deadlock under NCCL's rules; blocked batches: {blocked}.")
