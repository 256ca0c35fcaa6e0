"""What a pipeline schedule costs before it runs: its bubble under fixed cost models and the chunk micro-batches each
rank holds at its peak, read from the same action lists the executor runs (:func:`~.schedules.bubble_fraction`,
:func:`~.schedules.simulate`).

The public :func:`lightning_seqpar.explain` prints it under the rewrite with ``pp=``; with ``seq_len=`` it turns the
peak into bytes with the layer's memory choices (one layer's bytes per micro-batch × layers per chunk × the peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.schedules import bubble_fraction, chunks_per_rank, simulate

COST_MODELS = {"F = B = W": (1.0, 1.0, 1.0), "F:B:W = 1:1.2:0.8": (1.0, 1.2, 0.8)}
"""The fixed costs (F, B, W of one chunk) the bubble is reported under: equal, and a backward whose input-gradient
part is the heavier (Qi et al. 2024 profile B above W; the pipeline benchmark's ``B_HEAVY_COSTS``). For a schedule
without a split backward B + W is its whole backward."""


@dataclass(frozen=True)
class ScheduleReport:
    """One schedule at one pipeline size (see the module docstring).

    Attributes:
        schedule: the canonical name (``"interleaved_1F1B"`` for 1F1B with several chunks).
        pp: p, pipeline ranks.
        num_microbatches: m, micro-batches per step.
        chunks: v, model chunks per rank (2 on the V placement of ZB-V and DualPipeV).
        bubble: idle fraction of the step under each of :data:`COST_MODELS`, by its name.
        peak: per pipeline rank, the most chunk micro-batches held at once (a micro-batch counted from its forward to
            its last backward action: W under a split backward, where what waits between B and W is only the weight
            gradients' inputs, so this bounds it from above).
        chunk_layers: per pipeline rank, the layers of its largest model chunk (empty: the model's layers are not
            known, and the peak stays in micro-batches).
        layer_bytes: per memory choice, the bytes one layer keeps per micro-batch on one rank (empty: not asked).
    """

    schedule: str
    pp: int
    num_microbatches: int
    chunks: int
    bubble: dict[str, float]
    peak: tuple[int, ...]
    chunk_layers: tuple[int, ...] = ()
    layer_bytes: dict[str, float] = field(default_factory=dict)

    def peak_bytes(self, choice: str) -> tuple[float, ...]:
        """Per pipeline rank, the activation bytes held at the peak under memory choice ``choice``: peak chunk
        micro-batches × the layers of the rank's largest chunk × the layer's bytes (exact for an even split, an
        upper bound for an uneven one).

        Raises:
            KeyError: ``choice`` is not among :attr:`layer_bytes` (or the layers are not known).
        """
        if not self.chunk_layers or choice not in self.layer_bytes:
            raise KeyError(f"no bytes for memory choice {choice!r}: known {sorted(self.layer_bytes)} (explain with "
                           f"seq_len= gives them).")
        return tuple(n * layers * self.layer_bytes[choice] for n, layers in zip(self.peak, self.chunk_layers))

    def __str__(self) -> str:
        v = f", v={self.chunks}" if self.chunks > 1 else ""
        lines = [f"Pipeline schedule {self.schedule} at p={self.pp}, m={self.num_microbatches}{v}:"]
        lines += [f"  bubble ({name}): {fraction:.2%}" for name, fraction in self.bubble.items()]
        lines.append(f"  peak chunk micro-batches held per rank: {', '.join(map(str, self.peak))}"
                     + (f" (largest chunk per rank: {', '.join(map(str, self.chunk_layers))} layers)"
                        if self.chunk_layers else ""))
        if self.layer_bytes and self.chunk_layers:
            width = max(len(c) for c in self.layer_bytes)
            lines.append(f"  peak activation MiB per rank (rank 0 … {self.pp - 1}), by memory choice:")
            lines += [f"    {c:<{width}}  " + "  ".join(f"{b / 2**20:.3f}" for b in self.peak_bytes(c))
                      for c in self.layer_bytes]
        return "\n".join(lines)


def schedule_report(config: PipelineConfig, layers: Optional[int] = None,
                    layer_bytes: Optional[dict[str, float]] = None) -> ScheduleReport:
    """The :class:`ScheduleReport` of ``config`` (a validated pipeline configuration, ``pp > 1``) for a model of
    ``layers`` transformer layers, split as the strategy would split them.

    Raises:
        ValueError: ``pp`` below 2, or a stage split :meth:`PipelineConfig.layout` refuses.
    """
    if config.pp < 2:
        raise ValueError(f"pp={config.pp}: a pipeline schedule needs at least 2 pipeline ranks.")
    name, m, p = config.schedule, config.num_microbatches, config.pp
    v = chunks_per_rank(name, config.virtual_stages)
    chunk_layers: tuple[int, ...] = ()
    if layers is not None:
        stages = config.layout(layers)
        chunk_layers = tuple(max(stages.sizes[s] for s in stages.stages_of(r)) for r in range(p))
    bubble = {label: bubble_fraction(name, m, p, v, costs) for label, costs in COST_MODELS.items()}
    return ScheduleReport(name, p, m, v, bubble, tuple(simulate(name, m, p, v)), chunk_layers,
                          dict(layer_bytes or {}))
