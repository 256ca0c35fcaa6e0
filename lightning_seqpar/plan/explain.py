"""``lightning_seqpar.explain``: what the strategy would do to a model at a layout, before any process starts.

The rewrite's per-layer view (:func:`lightning_seqpar.policies.explain`: which modules become which parallel parts,
and with ``seq_len`` the bytes one layer keeps under each memory choice) and, with ``pp > 1``, the pipeline schedule's
bubble and each rank's peak (:mod:`lightning_seqpar.pipeline_parallel.report`), the stages split from the layer
stack of a copy rewritten on the meta device as the strategy splits its own.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch.nn as nn

from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.layout import Layout
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.pipeline_parallel.report import ScheduleReport, schedule_report
from lightning_seqpar.pipeline_parallel.stage import find_layer_stack
from lightning_seqpar.policies import explain as explain_rewrite
from lightning_seqpar.rewriting.policy import Policy
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.rewriting.rewriter import RewritePlan


def explain(model: nn.Module, tp: int, sequence_parallel: bool = True, policies: Optional[Iterable[Policy]] = None,
            loss_parallel: bool = True, verify: bool = True, cp: int = 1, cp_comm: str = "ring", ep: int = 1,
            moe: Optional[DispatchConfig] = None, seq_len: Optional[int] = None, micro_batch_size: int = 1,
            bytes_per_element: int = 2, expert_tp: int = 1, pp: int = 1, schedule: str = "1F1B",
            num_microbatches: Optional[int] = None, virtual_stages: int = 1,
            pipeline_split: Optional[Sequence[int]] = None) -> RewritePlan:
    """Print and return what ``SeqParallelStrategy(tp=tp, pp=pp, cp=cp, ep=ep, layout=Layout(...))`` with these
    settings (the other arguments: the :class:`~lightning_seqpar.Layout`'s fields) would do to ``model``; change
    nothing. The rewrite as
    :func:`lightning_seqpar.policies.explain` says it (with ``seq_len``: the bytes one layer keeps per micro-batch of
    ``micro_batch_size`` sequences under each memory choice), then with ``pp > 1`` the schedule's
    :class:`~lightning_seqpar.pipeline_parallel.report.ScheduleReport` as :attr:`RewritePlan.pipeline`: the bubble
    under F = B = W and under F:B:W = 1:1.2:0.8, each rank's peak chunk micro-batches, and with ``seq_len`` the peak
    activation bytes per rank under each memory choice.

    Needs no process group. Raises the ``ValueError`` the strategy would raise for the same settings: the rewrite's,
    and the pipeline's (an unknown schedule, too few micro-batches, a stage split that does not fit the layers).
    """
    layout = Layout(tp=tp, cp=cp, pp=pp, ep=ep, expert_tp=expert_tp, num_microbatches=num_microbatches,
                    schedule=schedule, virtual_stages=virtual_stages, pipeline_split=pipeline_split,
                    sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, cp_comm=cp_comm,
                    moe=moe or DispatchConfig())
    config = layout.pipeline
    # one rank of the smallest world the layout folds into: experts over ep·etp of the dense ranks
    ctx = RewriteContext.of(layout, ParallelMesh.virtual(layout.dims(tp * cp * pp * ep * expert_tp)))

    def pipeline(rewritten: nn.Module, memory: Optional[Any]) -> ScheduleReport:
        _, layers = find_layer_stack(rewritten)
        layer_bytes = {row.choice: row.device_bytes for row in memory.rows} if memory is not None else None
        return schedule_report(config, len(layers), layer_bytes)

    return explain_rewrite(model, ctx, policies, verify, seq_len, micro_batch_size, bytes_per_element,
                           pipeline if pp > 1 else None)
