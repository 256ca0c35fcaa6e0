"""``Layout``: how a model is split over the ranks and what each part runs with, as one frozen value.

The planner returns it (each :class:`~lightning_seqpar.plan.LayoutRecord` holds one), ``AutoLayout`` resolves to it,
the strategy takes it (``SeqParallelStrategy(layout=Layout(tp=2, pp=2, schedule="ZB-V"))``) and the layout report
reads it back: one vocabulary from the search to the run. The data-parallel size is not a field: it follows from the
world (``world / (t·c·p)``, :meth:`Layout.dims`). Torch-free, so the planner's pricing holds it.

Anchors: torchtitan's ``ParallelismConfig`` (one value handed to every ``parallelize_*``), Megatron-Core's
``TransformerConfig`` (sizes, pipeline, recomputation and offload in one place).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Literal, Mapping, Optional

from lightning_seqpar.context_parallel.comms import check_comm
from lightning_seqpar.memory.conflicts import BY_MODULE, OFFLOAD_MODULES
from lightning_seqpar.moe.dispatch_config import DispatchConfig
from lightning_seqpar.parallel.dims import ParallelDims, check_sizes
from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.schedules import SCHEDULES

GRANULARITIES = ("none", "selective", "full")
_TUPLES = ("pipeline_split", "recompute_modules", "offload")
SIZES = ("tp", "cp", "pp", "ep")
"""The sizes the strategy also takes as shorthands (``SeqParallelStrategy(tp=8)``, ``strategy.tp=8``)."""


@dataclass(frozen=True)
class Layout:
    """One layout: sizes, pipeline, what each parallelism runs with, the optimizer's sharding and the memory choices.

    Each field is checked alone when the value is made; the pipeline's fields together in :attr:`pipeline`, the sizes
    against the world in :meth:`dims` (both before any process group exists, in the strategy's constructor and
    launcher).

    Raises:
        ValueError: a size that is not a positive integer, an unknown schedule, ``cp_comm``, recomputation granularity
            or module, offload module or ZeRO stage; ``fp32_main_params`` without ``zero=1``; a ``loss_chunk`` or
            ``num_microbatches`` that is not a positive integer or ``None``; a ``moe`` mapping with unknown keys.
    """

    tp: int = 1
    """t: tensor-parallel size (ranks sharing each layer)."""
    cp: int = 1
    """c: context-parallel size (ranks sharing each sequence, attention included; a Hugging Face causal LM)."""
    pp: int = 1
    """p: pipeline-parallel size."""
    ep: int = 1
    """expert-parallel size: ranks holding different experts, folded over the dense ranks (the expert grid)."""
    expert_tp: int = 1
    """etp: ranks splitting each expert's width (1: whole experts); ``ep·expert_tp`` divides ``tp·cp·dp``."""
    num_microbatches: Optional[int] = None
    """m: micro-batches per batch (``None``: ``pp``; DualPipeV ``2·pp``)."""
    schedule: str = "1F1B"
    """one of :data:`~lightning_seqpar.pipeline_parallel.schedules.SCHEDULES`."""
    virtual_stages: int = 1
    """v: model chunks per pipeline rank (> 1: interleaved 1F1B; ZB-V and DualPipeV run 2)."""
    pipeline_split: Optional[tuple[int, ...]] = None
    """layers of each of the ``p·v`` stages, in model order (``None``: equal)."""
    sequence_parallel: bool = True
    """shard LayerNorm/dropout/residual activations along the sequence (Korthikanti et al. 2022 §4.2.2); ignored at
    ``tp == 1``."""
    loss_parallel: bool = True
    """compute the reference GPT's loss on vocabulary-sharded logits."""
    cp_comm: Literal["ring", "all_to_all"] = "ring"
    """context-parallel attention (:mod:`lightning_seqpar.context_parallel`)."""
    moe: DispatchConfig = field(default_factory=DispatchConfig)
    """how a mixture of experts dispatches: dropless (default), or with a capacity factor and drop policy."""
    zero: Literal[0, 1] = 0
    """1: the optimizer state sharded over the data-parallel ranks (ZeRO-1, Megatron's distributed optimizer)."""
    fp32_main_params: bool = False
    """with ``zero=1`` and 16-bit parameters: a float32 copy of each rank's element ranges (4 bytes / d each)."""
    loss_chunk: Optional[int] = 4096
    """positions a Hugging Face model's LM head and loss run over at once (``None``: all)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """recomputation granularity (the paper's selective: core attention; full: whole layers)."""
    recompute_modules: tuple[str, ...] = ()
    """modules recomputed by module beside it (:data:`~lightning_seqpar.memory.conflicts.BY_MODULE`)."""
    offload: tuple[str, ...] = ()
    """modules whose saved tensors wait in host memory (:data:`~lightning_seqpar.memory.conflicts.OFFLOAD_MODULES`)."""

    def __post_init__(self) -> None:
        check_sizes(tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, expert_tp=self.expert_tp,
                    virtual_stages=self.virtual_stages)
        for name in _TUPLES:  # a recipe's lists
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value) if not isinstance(value, str) else (value,))
        if isinstance(self.moe, Mapping):
            unknown = set(self.moe) - {"capacity_factor", "drop_policy"}
            if unknown:
                raise ValueError(f"moe={dict(self.moe)!r}: unknown key(s) {sorted(unknown)}; the keys are "
                                 f"capacity_factor and drop_policy.")
            object.__setattr__(self, "moe", DispatchConfig(**self.moe))
        if not isinstance(self.moe, DispatchConfig):
            raise ValueError(f"moe={self.moe!r}: a DispatchConfig(capacity_factor=..., drop_policy=...) or a mapping "
                             f"of those keys.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: one of {', '.join(SCHEDULES)}.")
        check_comm(self.cp_comm)
        for name in ("loss_chunk", "num_microbatches"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r}: a positive integer, or None.")
        if self.zero not in (0, 1):
            raise ValueError(f"zero={self.zero!r}: 0 (replicated optimizer state) or 1 (sharded over data-parallel "
                             f"ranks).")
        if self.fp32_main_params and self.zero != 1:
            raise ValueError("fp32_main_params=True keeps float32 main params with the sharded optimizer state, and "
                             "needs zero=1. Set zero=1 (and precision='bf16-true'), or leave fp32_main_params off.")
        if self.recompute not in GRANULARITIES:
            raise ValueError(f"recompute={self.recompute!r}: one of {', '.join(GRANULARITIES)}.")
        for name, known in (("recompute_modules", BY_MODULE), ("offload", OFFLOAD_MODULES)):
            unknown = [m for m in getattr(self, name) if m not in known]
            if unknown:
                raise ValueError(f"{name}={getattr(self, name)!r}: {unknown} unknown; the modules are {list(known)}.")

    @cached_property
    def pipeline(self) -> PipelineConfig:
        """The pipeline's fields together, canonical (m defaulted, a V's two chunks per rank).

        Raises:
            ValueError: from :meth:`~lightning_seqpar.pipeline_parallel.config.PipelineConfig.build`.
        """
        return PipelineConfig.build(self.pp, self.num_microbatches, self.schedule, self.virtual_stages,
                                    self.pipeline_split)

    def dims(self, world_size: int) -> ParallelDims:
        """The layout over ``world_size`` ranks, validated (the one check of the sizes together).

        Raises:
            ValueError: from :class:`~lightning_seqpar.parallel.dims.ParallelDims`.
        """
        return ParallelDims(world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.expert_tp)

    def replace(self, **changes: Any) -> "Layout":
        """This layout with ``changes``, checked again."""
        return replace(self, **changes)

    def changed(self) -> dict[str, Any]:
        """The fields away from their defaults, in field order."""
        default = Layout()
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value != getattr(default, name)}

    def __str__(self) -> str:
        """Python to paste back: ``Layout(tp=2, pp=2, schedule='ZB-V')``."""
        return f"Layout({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"

    def overrides(self, prefix: str = "strategy") -> str:
        """The same as a recipe's command-line overrides: the sizes as the strategy's shorthands, the rest under
        ``layout`` (``strategy.tp=2 strategy.layout.schedule=ZB-V``)."""
        def value(v: Any) -> str:
            if isinstance(v, DispatchConfig):
                return "{" + ",".join(f"{f.name}:{value(getattr(v, f.name))}" for f in fields(v)) + "}"
            if isinstance(v, tuple):
                return "[" + ",".join(map(value, v)) + "]"
            return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

        return " ".join(f"{prefix}{'' if k in SIZES else '.layout'}.{k}={value(v)}" for k, v in self.changed().items())
