"""The strategy's settings other than the layout, grouped by the part that owns them, each validated once, in its
constructor: ``checkpointing=CheckpointConfig(...)``, ``precision_config=PrecisionConfig(...)``,
``rewriting=RewriteConfig(...)``, ``launch=LaunchConfig(...)``. The layout (sizes, pipeline, parallelisms, ZeRO,
memory choices) is :class:`~lightning_seqpar.layout.Layout`. Each may be given as a mapping of its fields (a recipe's
``strategy.checkpointing.format=full``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal, Mapping, Optional, Sequence, TypeVar, Union

from lightning_seqpar.layout import Layout
from lightning_seqpar.lightning.launcher import check_start_method
from lightning_seqpar.lightning.process_group import as_timedelta
from lightning_seqpar.pipeline_parallel.schedules import splits_backward
from lightning_seqpar.transformer.compiling import CompileConfig, compile_config_of


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
            raise ValueError(f"CheckpointConfig(format={self.format!r}): 'sharded' or 'full'.")
        if self.format == "full" and self.async_save:
            raise ValueError("CheckpointConfig(format='full') gathers the whole optimizer onto every rank and writes "
                             "from rank 0; async_save=True needs format='sharded'.")


@dataclass(frozen=True)
class PrecisionConfig:
    """What the strategy adds to Lightning's ``precision=`` (``docs/precision.md``). Checked against the precision
    plugin at setup, where the plugin is known.
    """

    low_precision_residual: bool = False
    """under ``bf16-mixed`` / ``16-mixed``, carry the residual stream (hidden states, pipeline transfers, norm inputs
    kept) in 16 bits, as Megatron does: Table 2's bytes, 16-bit residual additions."""


@dataclass(frozen=True)
class RewriteConfig:
    """How the model's blocks are rewritten (:mod:`lightning_seqpar.rewriting`).

    Raises:
        ValueError: from :func:`~lightning_seqpar.transformer.compiling.compile_config_of`.
    """

    policies: Sequence[Any] = ()
    """extra :class:`~lightning_seqpar.Policy` objects for the user's own block classes."""
    verify: bool = True
    """check the rewrite before training, without communication: a Hugging Face causal LM whole (a small copy on
    emulated tp ranks), other declared blocks once per class and configuration."""
    compile: Union[bool, CompileConfig, Mapping[str, Any], None] = False
    """blocks through ``torch.compile(fullgraph=True)``: ``True``, a :class:`~lightning_seqpar.CompileConfig` or its
    mapping; held as a ``CompileConfig`` or ``None``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", tuple(self.policies or ()))
        object.__setattr__(self, "compile", compile_config_of(self.compile))


@dataclass(frozen=True)
class LaunchConfig:
    """How the ranks start and wait for each other.

    Raises:
        ValueError: an unknown ``start_method``; a ``timeout`` that is not a positive number of seconds or a
            ``timedelta``.
    """

    start_method: Literal["popen", "spawn", "fork"] = "popen"
    """``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``."""
    timeout: Union[float, timedelta, None] = None
    """how long a collective may wait for a peer before the job fails (seconds or a ``timedelta``; ``None``: torch's
    30 minutes): a stalled rank then ends the job with an error naming the collective, not a hang. Held as a
    ``timedelta``."""
    backend: Optional[str] = None
    """the process group's backend; ``None``: ``"nccl"`` on GPUs, ``"gloo"`` on CPUs."""

    def __post_init__(self) -> None:
        check_start_method(self.start_method)
        object.__setattr__(self, "timeout", as_timedelta(self.timeout))


Config = TypeVar("Config")


def config_of(value: Union[None, Config, Mapping[str, Any]], kind: type[Config], name: str) -> Config:
    """The strategy's ``name=`` argument as a ``kind``: the defaults for ``None``, a mapping's fields.

    Raises:
        ValueError: anything else, or a mapping with keys ``kind`` does not have.
    """
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(kind)}  # type: ignore[arg-type]
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{name}={dict(value)!r}: unknown key(s) {sorted(unknown)}; {kind.__name__} has "
                             f"{', '.join(sorted(known))}.")
        return kind(**value)
    raise ValueError(f"{name}={value!r}: a {kind.__name__}(...) or a mapping of its fields.")


def check_together(checkpointing: CheckpointConfig, layout: Layout, compiled: Optional[CompileConfig] = None) -> None:
    """What one group cannot check alone.

    Raises:
        ValueError: the pipeline's fields together (:attr:`~lightning_seqpar.Layout.pipeline`); ``zero=1`` with the
            full checkpoint format, or with experts split over ``expert_tp > 1`` (the
            distributed optimizer's element ranges of a tensor split twice are not described to checkpoints); a
            split schedule (ZB-H1, ZB-V, DualPipeV) with compiled blocks (``compiled``): a compiled block's backward
            is one graph.
    """
    pipeline = layout.pipeline  # its fields checked together (PipelineConfig.build)
    if checkpointing.format == "full" and layout.zero:
        raise ValueError("CheckpointConfig(format='full') gathers the whole optimizer onto every rank and writes from "
                         "rank 0; Layout(zero=1) needs format='sharded'.")
    if layout.expert_tp > 1 and layout.zero:
        raise ValueError(f"zero=1 with expert_tp={layout.expert_tp}: the distributed optimizer's element ranges of "
                         f"an expert split over both ep and expert_tp are not described to checkpoints. Use zero=0, "
                         f"or expert_tp=1 (whole experts, split over more ranks with ep).")
    if compiled is not None and splits_backward(pipeline.schedule):
        raise ValueError(f"schedule={pipeline.schedule!r} with compile=True: a compiled block's backward runs "
                         f"as one graph, so its weight gradients cannot be split from it into W actions. Train with "
                         f"RewriteConfig(compile=False), or with schedule='1F1B'.")
