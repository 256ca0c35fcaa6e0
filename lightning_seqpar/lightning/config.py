"""The strategy's settings, grouped by the part that owns them, each group validated once, in its constructor.

``SeqParallelStrategy`` takes these objects (``parallel=ParallelConfig(...)``, ``checkpointing=CheckpointConfig(...)``,
``data_parallel=...``, ``precision_config=PrecisionConfig(...)``) or the flat keywords they replace (``tp=``,
``checkpoint_format=``, ``zero=`` ...), which stay as shorthands. The pipeline's are
:class:`~lightning_seqpar.pipeline_parallel.config.PipelineConfig`, held by :class:`ParallelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from lightning_seqpar.context_parallel import ContextParallel
from lightning_seqpar.moe.capacity import DispatchConfig
from lightning_seqpar.parallel.dims import ParallelDims, check_sizes
from lightning_seqpar.pipeline_parallel import PipelineConfig
from lightning_seqpar.pipeline_parallel.schedules import splits_backward


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over the ranks: the layout's sizes and what each parallelism is run with.

    Raises:
        ValueError: a size that is not a positive integer, an unknown ``cp_comm``, a ``loss_chunk`` that is not a
            positive integer or ``None``. The world-dependent checks are :meth:`dims`'.
    """

    tp: int = 1
    """t: tensor-parallel size (ranks sharing each layer)."""
    cp: int = 1
    """c: context-parallel size (ranks sharing each sequence, attention included; a Hugging Face causal LM)."""
    cp_comm: Literal["ring", "all_to_all"] = "ring"
    """context-parallel attention (:mod:`lightning_seqpar.context_parallel`)."""
    ep: int = 1
    """expert-parallel size: ranks holding different experts, folded over the dense ranks (the expert grid)."""
    expert_tp: int = 1
    """etp, expert tensor-parallel size: ranks splitting each expert's width (1: whole experts on each rank of the
    expert-parallel group); ``ep·expert_tp`` divides ``tp·cp·dp`` (the expert grid folds over the dense one)."""
    moe: Optional[DispatchConfig] = field(default_factory=DispatchConfig)
    """how a mixture of experts dispatches: dropless (default), or with a capacity factor and drop policy."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig.build)
    """p, micro-batches, schedule, virtual stages and stage split."""
    sequence_parallel: bool = True
    """shard LayerNorm/dropout/residual activations along the sequence (Korthikanti et al. 2022 §4.2.2); ignored when
    ``tp == 1``."""
    loss_parallel: bool = True
    """compute the reference GPT's loss on vocabulary-sharded logits."""
    loss_chunk: Optional[int] = 4096
    """a Hugging Face model's LM head and loss run over this many positions at a time (``None``: all)."""

    def __post_init__(self) -> None:
        check_sizes(tp=self.tp, pp=self.pipeline.pp, cp=self.cp, ep=self.ep, expert_tp=self.expert_tp)
        if self.moe is None:
            object.__setattr__(self, "moe", DispatchConfig())
        if isinstance(self.moe, dict):  # a recipe's strategy.moe mapping
            unknown = set(self.moe) - {"capacity_factor", "drop_policy"}
            if unknown:
                raise ValueError(f"moe={self.moe!r}: unknown key(s) {sorted(unknown)}; the keys are capacity_factor and "
                                 f"drop_policy.")
            object.__setattr__(self, "moe", DispatchConfig(**self.moe))
        if not isinstance(self.moe, DispatchConfig):
            raise ValueError(f"moe={self.moe!r}: a DispatchConfig(capacity_factor=..., drop_policy=...) or a mapping "
                             f"of those keys.")
        ContextParallel.check_comm(self.cp_comm)
        chunk = self.loss_chunk
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"loss_chunk={chunk!r}: a positive number of sequence positions, or None (no chunks).")

    @property
    def pp(self) -> int:
        """p, the pipeline-parallel size."""
        return self.pipeline.pp

    def dims(self, world_size: int) -> ParallelDims:
        """The layout over ``world_size`` ranks, validated (the one check of the sizes together).

        Raises:
            ValueError: from :class:`~lightning_seqpar.parallel.dims.ParallelDims`.
        """
        return ParallelDims(world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.expert_tp)


def parallel_config_of(parallel: Optional[ParallelConfig], **shorthands: object) -> ParallelConfig:
    """``parallel``, or the :class:`ParallelConfig` of the strategy's flat keywords ``shorthands``.

    Raises:
        ValueError: ``parallel`` given together with a flat keyword set away from its default; from
            :class:`ParallelConfig`.
    """
    flat = ParallelConfig(**shorthands)  # type: ignore[arg-type]
    if parallel is None:
        return flat
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel={parallel!r}: a ParallelConfig(tp=..., cp=..., pipeline=PipelineConfig.build(...)).")
    default = ParallelConfig()
    both = [name for name in shorthands if getattr(flat, name) != getattr(default, name)]
    if both:
        raise ValueError(f"parallel=ParallelConfig(...) was given with the keyword(s) {', '.join(both)} too: give each "
                         f"setting once, inside ParallelConfig.")
    return parallel


@dataclass(frozen=True)
class CheckpointConfig:
    """How checkpoints are written and what loading accepts (the strategy's
    :class:`~lightning_seqpar.lightning.checkpointer.Checkpointer`).

    Raises:
        ValueError: an unknown ``format``; ``async_save`` with the full format.
    """

    format: Literal["sharded", "full"] = "sharded"
    """``"sharded"``: a directory written by every rank through ``torch.distributed.checkpoint``, which resumes under
    any other layout (:mod:`lightning_seqpar.checkpoint`); ``"full"``: one file of the single-device model and optimizer
    (small models; the same pipeline layout)."""
    async_save: bool = False
    """sharded format only: write checkpoints in a background thread while training goes on."""
    allow_non_finite: bool = False
    """load checkpoints whose weights or optimizer state hold NaN/inf (refused by default: they are corrupt, or the
    run had diverged)."""
    allow_unverified: bool = False
    """load a checkpoint whose manifest is gone, its files unchecked (refused by default)."""

    def __post_init__(self) -> None:
        if self.format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format must be 'sharded' or 'full', got {self.format!r}.")
        if self.format == "full" and self.async_save:
            raise ValueError("checkpoint_format='full' gathers the whole optimizer onto every rank and writes from "
                             "rank 0; async_save=True needs checkpoint_format='sharded'.")


@dataclass(frozen=True)
class DataParallelConfig:
    """How the optimizer state and gradients are kept over the data-parallel ranks
    (:class:`~lightning_seqpar.optim.grad_sync.GradientSync`).

    Raises:
        ValueError: an unknown ``zero``; ``fp32_main_params`` without ``zero=1``.
    """

    zero: Literal[0, 1] = 0
    """``1`` shards the optimizer state over the data-parallel ranks (ZeRO-1,
    :mod:`lightning_seqpar.optim.distributed_optimizer`); ``0`` replicates it."""
    fp32_main_params: bool = False
    """with ``zero=1`` and 16-bit parameters (``precision="bf16-true"``), update a float32 copy of each rank's element
    ranges and round it into the parameters (Megatron's main params: 4 bytes / d each)."""

    def __post_init__(self) -> None:
        if self.zero not in (0, 1):
            raise ValueError(f"zero must be 0 (replicated optimizer state) or 1 (sharded over data-parallel ranks), "
                             f"got {self.zero!r}.")
        if self.fp32_main_params and self.zero != 1:
            raise ValueError("fp32_main_params=True keeps float32 main params with the sharded optimizer state, and "
                             "needs zero=1. Set zero=1 (and precision='bf16-true'), or leave fp32_main_params off.")


@dataclass(frozen=True)
class PrecisionConfig:
    """What the strategy adds to Lightning's ``precision=`` (``docs/precision.md``). Checked against the precision
    plugin at setup, where the plugin is known.
    """

    low_precision_residual: bool = False
    """under ``bf16-mixed`` / ``16-mixed``, carry the residual stream (hidden states, pipeline transfers, norm inputs
    kept) in 16 bits, as Megatron does: Table 2's bytes, 16-bit residual additions."""


def check_together(checkpointing: CheckpointConfig, data_parallel: DataParallelConfig,
                   parallel: Optional[ParallelConfig] = None, compiled: Optional[Any] = None) -> None:
    """What one group cannot check alone.

    Raises:
        ValueError: ``zero=1`` with the full checkpoint format, or with experts split over ``expert_tp > 1`` (the
            distributed optimizer's element ranges of a tensor split twice are not described to checkpoints); a
            split schedule (ZB-H1, ZB-V, DualPipeV) with compiled blocks (``compiled``: a compile configuration): a
            compiled block's backward is one graph.
    """
    if checkpointing.format == "full" and data_parallel.zero:
        raise ValueError("checkpoint_format='full' gathers the whole optimizer onto every rank and writes from rank 0; "
                         "zero=1 needs checkpoint_format='sharded'.")
    if parallel is not None and parallel.expert_tp > 1 and data_parallel.zero:
        raise ValueError(f"zero=1 with expert_tp={parallel.expert_tp}: the distributed optimizer's element ranges of "
                         f"an expert split over both ep and expert_tp are not described to checkpoints. Use zero=0, "
                         f"or expert_tp=1 (whole experts, split over more ranks with ep).")
    pipeline = parallel.pipeline if parallel is not None else None
    if compiled is not None and pipeline is not None and splits_backward(pipeline.schedule):
        raise ValueError(f"schedule={pipeline.schedule!r} with compile=True: a compiled block's backward runs as one "
                         f"graph, so its weight gradients cannot be split from it into W actions. Train with "
                         f"compile=False, or with schedule='1F1B'.")
