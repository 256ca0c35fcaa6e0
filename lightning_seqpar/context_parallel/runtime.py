"""The context-parallel settings of a rewritten model and the layout of the forward running now.

The model-level entry (:mod:`lightning_seqpar.hf.context_parallel` for Hugging Face causal LMs) works out a
forward's :class:`~.layout.ContextParallelBatch` from the whole batch, which every cp rank holds, and opens it with
:meth:`ContextParallel.forward_of`; the parallel layers read it once at their call (:meth:`ContextParallel.layout`) and
pass it down as their mask, so a recomputed layer or a pipelined micro-batch's backward uses the layout of its own
forward, never the one open later. One object per rewrite, held by the layers and the model entry: no global state.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from lightning_seqpar.context_parallel.layout import ContextParallelBatch
from lightning_seqpar.parallel.collectives import ParallelGroup

COMMS = ("ring", "all_to_all")


class ContextParallel:
    """Context parallelism of one rewrite.

    With one cp rank (``c = 1``) it serves packed documents: a forward given ``position_ids`` opens a layout whose
    documents start where they restart at 0, and attention stays inside each (transformers' eager and SDPA kernels
    would attend across them).

    Args:
        group: the context-parallel group (size c ≥ 1).
        comm: ``"ring"`` or ``"all_to_all"`` (:mod:`.attention`).

    Raises:
        ValueError: an unknown ``comm``.
    """

    def __init__(self, group: ParallelGroup, comm: str = "ring") -> None:
        self.group, self.comm = group, self.check_comm(comm)
        self._current: Optional[ContextParallelBatch] = None
        self._stack: list[Optional[ContextParallelBatch]] = []

    @staticmethod
    def check_comm(comm: str) -> str:
        """``comm`` if it names a context-parallel attention.

        Raises:
            ValueError: an unknown ``comm``.
        """
        if comm not in COMMS:
            raise ValueError(f"cp_comm={comm!r}: context-parallel attention is 'ring' or 'all_to_all'.")
        return comm

    @property
    def c(self) -> int:
        return self.group.size

    @contextmanager
    def forward_of(self, layout: Optional[ContextParallelBatch]) -> Iterator[Optional[ContextParallelBatch]]:
        """:meth:`open` ``layout`` for the block inside, :meth:`close` after it (nested forwards restore the outer
        one)."""
        self.open(layout)
        try:
            yield layout
        finally:
            self.close()

    def open(self, layout: Optional[ContextParallelBatch]) -> None:
        """Open ``layout`` until :meth:`close` (a model's forward pre-hook and forward hook); ``None`` (one cp rank
        and nothing to mask beyond the model's own masks): the layers use the model's masks."""
        self._stack.append(self._current)
        self._current = layout

    def close(self) -> None:
        """Close the layout :meth:`open` opened last."""
        self._current = self._stack.pop() if self._stack else None

    def layout(self, where: str) -> Optional[ContextParallelBatch]:
        """The open forward's layout (``None`` on one cp rank when the model's masks serve).

        Raises:
            RuntimeError: ``c > 1`` and no forward of the whole model is open: a layer called on its own holds only its
                tokens and cannot know which positions they are.
        """
        if self._current is None and self.c > 1:
            raise RuntimeError(f"{where} runs under context parallelism (cp={self.c}) and was called outside a "
                               f"forward that split the sequence over the cp ranks. A Hugging Face causal LM or the "
                               f"reference GPT does it when called whole (model(input_ids=..., labels=...)); a model of "
                               f"your own blocks takes its tokens in `with lightning_seqpar.context_parallel_batch("
                               f"self, input_ids, labels=...) as part:` (see its docstring).")
        return self._current

    def __getstate__(self) -> dict:  # a pickled model describes one rank; no forward is open in a copy
        return {"group": self.group, "comm": self.comm, "_current": None, "_stack": []}
