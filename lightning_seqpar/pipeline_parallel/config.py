"""One object for everything the pipeline is configured with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.schedules import (ScheduleName, check_microbatches, chunks_per_rank,
                                                          least_microbatches, stage_placement_of, resolve_schedule)


@dataclass(frozen=True)
class PipelineConfig:
    """A validated pipeline configuration (the strategy's ``pp``, ``num_microbatches``, ``schedule``,
    ``virtual_stages`` and ``pipeline_split``). Process groups and ranks come from the mesh, not from here.

    Build it with :meth:`build`, which checks every value before any process starts.
    """

    pp: int
    """p: pipeline-parallel size."""
    num_microbatches: int
    """m: micro-batches per (per-rank) batch."""
    schedule: ScheduleName
    """canonical schedule name (``"1F1B"``, ``"gpipe"``, ``"interleaved_1F1B"``, ``"ZB-H1"``, ``"ZB-V"``,
    ``"DualPipeV"``)."""
    virtual_stages: int = 1
    """v: model chunks per pipeline rank (2 for ZB-V and DualPipeV, whatever was asked)."""
    split: Optional[tuple[int, ...]] = None
    """layers of each of the ``p·v`` virtual stages, in model order (``None``: equal)."""

    @classmethod
    def build(cls, pp: int = 1, num_microbatches: Optional[int] = None, schedule: str = "1F1B",
              virtual_stages: int = 1, split: Optional[Sequence[int]] = None) -> "PipelineConfig":
        """Validate and canonicalize; ``num_microbatches`` defaults to ``pp`` (DualPipeV: ``2·pp``, the least it runs);
        a V-shaped schedule's ``virtual_stages`` becomes 2.

        Raises:
            ValueError: from :func:`~.schedules.resolve_schedule` and, when ``pp > 1``,
                :func:`~.schedules.check_microbatches`; a ``split`` of the wrong length or with an empty stage (its sum
                is checked against the model's layers when they are known: :meth:`layout`).
        """
        name = resolve_schedule(schedule, virtual_stages)
        virtual_stages = chunks_per_rank(name, virtual_stages)
        m = num_microbatches if num_microbatches is not None else least_microbatches(name, pp)
        if pp > 1:
            check_microbatches(m, pp, name)
        if split is not None and (len(split) != pp * virtual_stages or any(int(n) < 1 for n in split)):
            raise ValueError(f"pipeline_split={list(split)} must give {pp * virtual_stages} positive layer counts "
                             f"(pp={pp} × virtual_stages={virtual_stages}), one per stage.")
        return cls(pp, m, name, virtual_stages, tuple(split) if split is not None else None)

    @property
    def enabled(self) -> bool:
        """Whether the model is split into stages (``pp > 1``)."""
        return self.pp > 1

    def layout(self, num_layers: int) -> StageLayout:
        """The stage layout of a stack of ``num_layers`` layers.

        Raises:
            ValueError: from :meth:`StageLayout.build`.
        """
        placement = stage_placement_of(self.schedule)
        return StageLayout.build(num_layers, self.pp, self.virtual_stages, self.split, placement)
