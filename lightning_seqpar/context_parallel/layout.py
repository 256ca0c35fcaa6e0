"""Which tokens a context-parallel rank holds, and what each of its attention blocks may see.

Causal attention costs a query in proportion to its position, so a contiguous split would leave the last rank
most of the work. The sequence is cut into ``2c`` chunks of ``n = s/(2c)`` tokens and cp rank ``r`` keeps chunks
``r`` and ``2c−1−r`` (Megatron-LM / Transformer Engine's load balancing for causal context parallelism; torch's
head-tail balancer): every rank then has the same number of visible query-key pairs.

A :class:`ContextParallelBatch` is one forward's layout: the chunk ids of every rank and, per token of the whole
sequence, its document (packed rows) and whether it is padding. They are ``[b, s]`` integers and flags, known to
every rank from the batch it already holds (cp ranks share a batch), so the mask of any block of queries against
keys is built locally, ``[b, n, n]`` at a time: no rank makes an ``s × s`` tensor.

The layout reaches the layers as data with their call, under the keyword :data:`LAYOUT_ARGUMENT` (as transformers
passes packed sequences' ``cu_seq_lens`` from the model's call to its layers, and Megatron-LM its
``packed_seq_params``): a recomputed layer or a pipelined micro-batch's backward is called again with the same
arguments, so it uses the layout of its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup


LAYOUT_ARGUMENT = "context_parallel_layout"
"""The keyword under which a :class:`ContextParallelBatch` travels with a call, from the model's entry to its parallel
layers (a Hugging Face model passes its call's keyword arguments on to its decoder layers)."""


def chunks_of_rank(c: int, r: int) -> tuple[int, int]:
    """The two chunk ids (of ``2c``) cp rank ``r`` holds: ``(r, 2c − 1 − r)``."""
    return r, 2 * c - 1 - r


def check_context_length(s: int, c: int, t: int, where: str) -> None:
    """Raise ``ValueError`` unless ``s`` splits into ``2c`` chunks that sequence parallelism splits ``t`` ways.

    Raises:
        ValueError: naming ``s``, ``2·c·t`` and the fix.
    """
    unit = 2 * c * t if c > 1 else 2  # one cp rank: two chunks; sequence parallelism checks its own split
    if s % unit and c == 1:
        raise ValueError(f"{where}: sequence length {s} is odd, but packed documents (position_ids restarting at 0) are "
                         f"attended in two halves of the sequence. Use an even length (pad the batch, or change the "
                         f"block size).")
    if s % unit:
        raise ValueError(f"{where}: sequence length {s} is not divisible by 2·cp·tp = 2·{c}·{t} = {unit}: context "
                         f"parallelism cuts the sequence into 2·cp chunks (load balancing), each split over tp under "
                         f"sequence parallelism. Use a multiple of {unit} (pad the batch, or change the block size).")


def local_indices(s: int, c: int, r: int, device: Optional[torch.device] = None) -> Tensor:
    """The sequence positions cp rank ``r`` holds, in its local order: chunk ``r`` then chunk ``2c−1−r``
    (``[s/c]``, int64)."""
    n = s // (2 * c)
    first, second = chunks_of_rank(c, r)
    return torch.cat([torch.arange(first * n, (first + 1) * n, device=device),
                      torch.arange(second * n, (second + 1) * n, device=device)])


def documents_from_positions(position_ids: Tensor) -> Tensor:
    """Document ids ``[b, s]`` of packed rows whose position ids restart at 0 at each document's first token
    (transformers' ``DataCollatorWithFlattening``): the count of restarts so far."""
    return (position_ids == 0).long().cumsum(-1)


@dataclass
class ContextParallelBatch:
    """The layout of one forward under context parallelism (see the module docstring).

    Attributes:
        group: the context-parallel group (size c).
        comm: ``"ring"`` (K/V passed around the cp ring) or ``"all_to_all"`` (heads scattered, sequence gathered).
        seq_len: s, the global sequence length.
        documents: ``[b, s]`` document id per token (packed rows), or ``None``: one document per row.
        padding: ``[b, s]`` bool, ``True`` where the token is padding (keys never attended), or ``None``.
        window: sliding window w (a query sees keys at most ``w − 1`` positions back), or ``None``.
        delivered: ``[True]`` once a parallel layer has received this layout (shared with its :meth:`with_window`
            copies): the model's entry checks it after the forward, so a model that does not pass its call's keyword
            arguments on to its layers is refused instead of attending across packed documents.
    """

    group: ParallelGroup
    comm: str
    seq_len: int
    documents: Optional[Tensor] = None
    padding: Optional[Tensor] = None
    window: Optional[int] = None
    delivered: list[bool] = field(default_factory=lambda: [False], repr=False, compare=False)

    @property
    def c(self) -> int:
        return self.group.size

    @property
    def chunk(self) -> int:
        """n, tokens per chunk: ``s / (2c)``."""
        return self.seq_len // (2 * self.c)

    def chunks(self, r: Optional[int] = None) -> tuple[int, int]:
        """The chunk ids cp rank ``r`` (default: this rank) holds."""
        return chunks_of_rank(self.c, self.group.rank if r is None else r)

    def with_window(self, window: Optional[int]) -> "ContextParallelBatch":
        """The same layout for a layer with sliding window ``window`` (``None``: full causal)."""
        if window == self.window:
            return self
        return ContextParallelBatch(self.group, self.comm, self.seq_len, self.documents, self.padding, window,
                                    self.delivered)

    def block_mask(self, q_chunk: int, k_chunk: int, device: Optional[torch.device] = None
                   ) -> tuple[str, Optional[Tensor]]:
        """What queries of chunk ``q_chunk`` see of keys of chunk ``k_chunk``: ``("skip", None)`` (nothing, the
        block is not computed), ``("full", None)`` (every key) or ``("mask", allowed)`` with ``allowed``
        ``[b, n, n]`` bool (``True`` = attend; causality, documents, padding and the window) on ``device`` (the
        queries' device; ``None``: the batch's documents or padding, else the CPU). Decided from chunk ids alone
        where the batch's data cannot change the answer: no host synchronization."""
        n = self.chunk
        if k_chunk > q_chunk:
            return "skip", None
        if self.window is not None and q_chunk * n - ((k_chunk + 1) * n - 1) >= self.window:
            return "skip", None  # every key is outside every query's window
        window_covers = self.window is None or (q_chunk + 1) * n - 1 - k_chunk * n < self.window
        if k_chunk < q_chunk and window_covers and self.documents is None and self.padding is None:
            return "full", None
        if device is None:
            device = self.documents.device if self.documents is not None else (
                self.padding.device if self.padding is not None else None)
        # Made where the scores are: a plain causal batch carries no tensor to take a device from, and a CPU mask
        # against CUDA scores fails (masked_fill) or copies host to device every block.
        q_pos = torch.arange(q_chunk * n, (q_chunk + 1) * n, device=device)
        k_pos = torch.arange(k_chunk * n, (k_chunk + 1) * n, device=device)
        distance = q_pos[:, None] - k_pos[None, :]  # [n, n]
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        allowed = allowed.unsqueeze(0)  # [1, n, n]
        if self.documents is not None:
            q_doc = self.documents[:, q_chunk * n:(q_chunk + 1) * n]
            k_doc = self.documents[:, k_chunk * n:(k_chunk + 1) * n]
            allowed = allowed & (q_doc[:, :, None] == k_doc[:, None, :])
        if self.padding is not None:
            allowed = allowed & ~self.padding[:, None, k_chunk * n:(k_chunk + 1) * n]
        return "mask", allowed
