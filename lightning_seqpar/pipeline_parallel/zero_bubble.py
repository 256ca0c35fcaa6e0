"""The zero-bubble schedules' action lists: ZB-H1, ZB-V and DualPipeV.

Each splits a backward into B (the input gradient, which the previous stage waits for) and W (the weight gradient,
which nothing waits for: :mod:`lightning_seqpar.tensor_parallel.weight_gradients`) and places the W's where a rank
would otherwise idle. ZB-V and DualPipeV run two model chunks per rank in the V placement of
:mod:`~lightning_seqpar.pipeline_parallel.layout` (chunk 0 = stage r, chunk 1 = stage 2p − 1 − r).

Sources: Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024 (§2.1 ZB-H1, §4 ZB-V); DeepSeek-AI,
*DeepSeek-V3 Technical Report* (2024) §3.2.1 and the DualPipe repository's ``dualpipev.py`` (DualPipeV, the V half of
DualPipe); torch's ``ScheduleDualPipeV`` builds the same lists.
"""

from __future__ import annotations

from lightning_seqpar.pipeline_parallel.actions import Action


def zb_h1(m: int, p: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024 §2.1): 1F1B's forwards and input-gradient backwards B, with rank r's weight-gradient halves
    W delayed by r micro-batches, so that every rank holds p micro-batches (from F to W) in the steady state, as 1F1B's
    first rank does (``p − r`` whole, r waiting for their W only): the peak stays 1F1B's, and the W's fill the tail's
    bubble. With F = B = W the bubble is ``(p − 1)/(3m + p − 1)`` against 1F1B's ``(p − 1)/(m + p − 1)``."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    pending: list[int] = []

    def backward(i: int) -> None:
        actions.append(Action("B", 0, i))
        pending.append(i)
        if len(pending) > rank:
            actions.append(Action("W", 0, pending.pop(0)))

    for i in range(m - warmup):
        actions.append(Action("F", 0, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return actions + [Action("W", 0, i) for i in pending]


def zb_v(m: int, p: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024 §4): two chunks per rank in the V placement, chunk 0 = stage r, chunk 1 = stage 2p − 1 − r,
    the backward split into B and W.

    A micro-batch's chunk-1 forward reaches rank r ``2(p − r) − 1`` forward times after its chunk-0 forward left it,
    and its chunk-1 input gradient ``2r`` times after that; the lists fill exactly those gaps. Warm-up: ``2(p − r) − 1``
    chunk-0 forwards, then r pairs (chunk-1 forward, chunk-0 forward), then ``p − r`` chunk-1 forward-B-W triples.
    Steady state: F, B and W of chunk 0, then of chunk 1. Cool-down: the B's left (chunk-1 W's wait), then every W.
    Each rank holds at most 2p chunk micro-batches from F to W: p whole-model-slice micro-batches, 1F1B's first
    stage's peak. With F = B = W and ``m >= 2p − 2`` the only idle time is rank r's r units before its first forward
    and ``p − 1 − r`` after its last W: a bubble of ``(p − 1)/(6m + p − 1)``, the least any schedule of p ranks
    reaches (the last rank cannot start earlier and holds 6m units of work). Any ``m >= p`` runs (the warm-up
    shortens when fewer micro-batches exist, and the bubble grows)."""
    actions: list[Action] = []
    done = {kind: [0, 0] for kind in "FBW"}
    ready = {"F": lambda c: m, "B": lambda c: done["F"][c], "W": lambda c: done["B"][c]}

    def run(*steps: str) -> None:
        for kind, chunk in steps:  # each as "F0", "B1"...: skipped once its chunk has none left
            c = int(chunk)
            if done[kind][c] < ready[kind](c):
                actions.append(Action(kind, c, done[kind][c]))
                done[kind][c] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F0")
    for _ in range(rank):
        run("F1", "F0")
    for _ in range(p - rank):
        run("F1", "B1", "W1")
    while done["F"][0] < m or done["F"][1] < m:
        run("F0", "B0", "W0", "F1", "B1", "W1")
    while done["B"][1] < m:
        run("B0", "B1")
    while done["B"][0] < m:
        run("B0", "W0")
    while done["W"][1] < m:
        run("W1")
    while done["W"][0] < m:
        run("W0")
    return actions


def dualpipe_v(m: int, p: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3 §3.2.1, DualPipe's ``dualpipev.py``): ZB-V's placement, with the steady state made of
    forward-backward pairs of two micro-batches: the forward of one chunk, then the whole backward (B and its W at
    once) of the other. DeepSeek's executor overlaps each pair, one micro-batch's communication hidden under the other's
    computation; this list runs them one after the other (the bubble and peak below are the list's).

    Rank r's list, in DeepSeek's eight steps: ``2(p − r − 1)`` chunk-0 forwards; ``r + 1`` pairs of forwards (chunk 0,
    chunk 1); ``p − r − 1`` zero-bubble triples of chunk 1 (B, W, F); ``m − 2p + r + 1`` steady pairs of pairs
    (F0 with B1, F1 with B0); ``p − r − 1`` times B1 then the pair (F1, B0); ``r + 1`` pairs of backwards (B1, B0),
    whose second half defers W; ``p − r − 1`` times a W then a deferred B0; the last ``r + 1`` W's. A rank holds at
    most ``2p + 1`` chunk micro-batches from F to W at p ≥ 2 (ZB-V: 2p), DeepSeek's "PP + 1".

    Raises:
        ValueError: ``m < 2p`` (DeepSeek's and torch's requirement: the warm-up alone sends 2p micro-batches through
            the first chunk of rank 0).
    """
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2·pp micro-batches; got num_microbatches={m} with pp={p}. "
                         f"Use num_microbatches >= {2 * p}.")
    actions: list[Action] = []
    count = {kind: [0, 0] for kind in "FB"}
    deferred: list[tuple[int, int]] = []  # (chunk, micro-batch) whose B ran and whose W waits, oldest first

    def forward(chunk: int) -> None:
        actions.append(Action("F", chunk, count["F"][chunk]))
        count["F"][chunk] += 1

    def backward(chunk: int, split: bool) -> None:
        i = count["B"][chunk]
        count["B"][chunk] += 1
        actions.append(Action("B", chunk, i))
        if split:
            deferred.append((chunk, i))
        else:
            actions.append(Action("W", chunk, i))

    def weight() -> None:
        if deferred:
            chunk, i = deferred.pop(0)
            actions.append(Action("W", chunk, i))

    for _ in range(2 * (p - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + rank + 1):
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(p - rank - 1):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    for i in range(rank + 1):
        # the second half of these backwards defers its W, odd ranks from chunk 1, even from chunk 0 (DeepSeek's)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(0, split)
    for _ in range(p - rank - 1):
        weight()
        backward(0, split=True)
    while deferred:
        weight()
    return actions
