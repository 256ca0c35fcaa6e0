"""The context-parallel settings of a rewritten model: its cp group and attention kind.

It holds no forward's state. The model's entry (:mod:`lightning_seqpar.hf.context_parallel` for Hugging Face causal
LMs, the reference GPT's forward, the rewritten ``nn.TransformerEncoder``, or the user's step through
:func:`~.batch.context_parallel_batch`) works out a forward's :class:`~.layout.ContextParallelBatch` from the whole
batch, which every cp rank holds, and passes it with the layers' call (:data:`~.layout.LAYOUT_ARGUMENT`); each
layer checks what it received with :meth:`ContextParallel.layer_layout`.
"""

from __future__ import annotations

from typing import Optional

from lightning_seqpar.context_parallel.comms import check_comm
from lightning_seqpar.context_parallel.layout import LAYOUT_ARGUMENT, ContextParallelBatch
from lightning_seqpar.parallel.collectives import ParallelGroup


class ContextParallel:
    """Context parallelism of one rewrite.

    With one cp rank (``c = 1``) it serves packed documents: a forward given ``position_ids`` passes a layout whose
    documents start where they restart at 0, and attention stays inside each (transformers' eager and SDPA kernels
    would attend across them).

    Args:
        group: the context-parallel group (size c ≥ 1).
        comm: ``"ring"`` or ``"all_to_all"`` (:mod:`.attention`).

    Raises:
        ValueError: an unknown ``comm``.
    """

    def __init__(self, group: ParallelGroup, comm: str = "ring") -> None:
        self.group, self.comm = group, check_comm(comm)

    @property
    def c(self) -> int:
        return self.group.size

    def layer_layout(self, layout: Optional[ContextParallelBatch], where: str) -> Optional[ContextParallelBatch]:
        """The layout a layer received with its call (``None`` on one cp rank when the model's masks serve), marked
        delivered.

        Raises:
            RuntimeError: ``c > 1`` and no layout came with the call: a layer called on its own holds only its tokens
                and cannot know which positions they are.
        """
        if layout is None and self.c > 1:
            raise RuntimeError(f"{where} runs under context parallelism (cp={self.c}) and was called outside a "
                               f"forward that split the sequence over the cp ranks (no {LAYOUT_ARGUMENT}= came with "
                               f"its call). A Hugging Face causal LM or the reference GPT does it when called whole "
                               f"(model(input_ids=..., labels=...)), if its forward passes its keyword arguments on to "
                               f"its layers (Falcon's does not: train it with cp=1); a model of your own blocks takes "
                               f"its tokens with `part = lightning_seqpar.context_parallel_batch(self, input_ids, "
                               f"labels=...)` and passes **part.layer_arguments to each block (see its docstring).")
        if layout is not None:
            layout.delivered[0] = True
        return layout
