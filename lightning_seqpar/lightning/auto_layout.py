"""``SeqParallelStrategy(layout=AutoLayout(...))``: the planner's best layout, chosen before the process groups exist.

From the model (built on the meta device where it is not built yet, through its ``configure_model``; a Hugging Face
causal LM, or a model whose ``config`` declares ``planned_config()``, as the reference GPT does), the world size
and each device's memory (CUDA's total, or ``memory_budget``), :func:`choose_layout` asks
:func:`lightning_seqpar.plan.plan` for every layout of tensor, context (ring or all-to-all, ``cp_comm``), pipeline
(with virtual stages) and data parallelism, micro-batch and recomputation whose most loaded rank fits in ``headroom``
of that memory, and gives the strategy the best ranked one before anything is allocated on a device: ``tp``, ``cp``,
``pp``, the schedule's micro-batches and virtual stages, the expert-parallel size of a mixture of experts (the one
given, ``ep=e``, or the planner's choice when left at 1), the pipeline schedule, and the recomputation (a
:class:`~lightning_seqpar.SelectiveRecompute` callback, unless the run has one: its granularity then bounds the
search; with ``memory_choices``, recomputation by module and activation offload too). The choice, why, and the
runner-up are logged once with their predicted bytes. When
nothing fits it refuses, naming the smallest world size and the longest sequence (halved until it fits) that would.

The loader's batch is per data-parallel rank (Lightning's convention; context-parallel peers read the same batch):
``batch_size`` here. The data-parallel size follows from the choice (``world / (tp·cp·pp)``), so the global batch is
``batch_size × dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_seqpar.pipeline_parallel.schedules import SEARCHED_SCHEDULES, splits_backward
from lightning_seqpar.sizes import parse_bytes


@dataclass(frozen=True)
class AutoLayout:
    """What ``layout="auto"`` plans for.

    Attributes:
        seq_len: s, tokens per sequence of the training batches.
        batch_size: sequences per data-parallel rank and optimizer step (the train loader's ``batch_size``).
        memory_budget: one device's memory: bytes, or a size as written (``"80GB"``, ``"24GiB"``,
            :func:`~lightning_seqpar.sizes.parse_bytes`); ``None``: the CUDA device's total (required on CPU).
        headroom: the fraction of ``memory_budget`` a layout's most loaded rank may fill (Fujii et al.: 0.8).
        micro_batches: micro-batch sizes the pipeline may use (each must divide ``batch_size``).
        calibration: a file ``python -m lightning_seqpar.plan calibrate --out FILE`` wrote on this kind of machine:
            layouts are ranked by a step time from its measured rates (``None``: nominal rates, a rough estimate).
        context_parallel: the context-parallel sizes c to consider (``None``: every divisor of the world; ``(1,)``:
            none). Each rank of ``cp = c`` holds ``s/c`` tokens; ``s`` must be a multiple of ``2·c·t`` (the planner
            rejects the others, naming the rule).
        cp_comm: the context-parallel attention's communication, ``"ring"`` or ``"all_to_all"`` (heads divided by
            ``c·t``).
        memory_choices: a layout too large for the memory is tried again with recomputation by module and
            activation offload (the planner's ``memory_choices``,
            :data:`~lightning_seqpar.plan.pricing.memory_choices.TRADES`);
            one that fits competes by step time, and when chosen the run gets the ``SelectiveRecompute(modules=...)``
            and ``ActivationOffload(modules=...)`` callbacks it was priced with (not beside callbacks of the run's own).
        schedules: the pipeline schedules to search (``1F1B``, interleaved where vpp > 1, ``ZB-H1``, ``ZB-V`` and
            ``DualPipeV``; a run with ``compile=True`` searches 1F1B only: a compiled block's backward cannot be split
            into B and W).
        loss_chunks: the ``loss_chunk`` values to search (positions of a Hugging Face model's logits computed at a
            time; ``None`` in it: all of them); the strategy takes the chosen one. ``None``: the strategy's own
            ``loss_chunk`` only. The reference GPT's loss computes its logits whole whatever it says.
        zero: the ZeRO stage the chosen layout runs with (``1``: the optimizer state sharded over the data-parallel
            ranks, priced so).
        cache: where the planner's probe fits are kept between runs (``True``: the planner's own directory,
            :func:`~lightning_seqpar.plan.measuring.fit_cache.default_cache_directory`, shared with ``python -m
            lightning_seqpar.plan``; a path; ``False``: this run's memory only). A run launched again, on another
            world size, batch or sequence length, probes nothing it probed before.

    Raises:
        ValueError: a size below 1, a ``memory_budget`` that is not a size (or text without a unit below 1 MiB),
            a headroom outside (0, 1], a context-parallel size below 1, an unknown ``cp_comm``, schedule or ZeRO
            stage, or a calibration file that is missing or damaged.
    """

    seq_len: int
    batch_size: int
    memory_budget: Union[float, str, None] = None
    headroom: float = 0.8
    micro_batches: tuple[int, ...] = (1, 2, 4)
    calibration: Optional[str] = None
    context_parallel: Optional[tuple[int, ...]] = None
    cp_comm: str = "ring"
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    memory_choices: bool = False
    loss_chunks: Optional[tuple[Optional[int], ...]] = None
    cache: Union[bool, str] = True
    zero: int = 0

    def __post_init__(self) -> None:
        if self.memory_budget is not None:  # "80GB", "24GiB", 24e9 (unitless text below 1 MiB is refused)
            object.__setattr__(self, "memory_budget", float(parse_bytes(self.memory_budget, "memory_budget")))
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError(f"AutoLayout needs seq_len >= 1 and batch_size >= 1, got {self.seq_len}, {self.batch_size}.")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"AutoLayout.headroom={self.headroom}: a fraction of the device memory in (0, 1].")
        if self.context_parallel is not None and (not self.context_parallel or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.context_parallel)):
            raise ValueError(f"AutoLayout.context_parallel={self.context_parallel!r}: positive sizes, e.g. (1, 2, 4), "
                             f"or None for every divisor of the world.")
        if not self.schedules or any(s not in SEARCHED_SCHEDULES for s in self.schedules):
            raise ValueError(f"AutoLayout.schedules={self.schedules!r}: some of "
                             f"{', '.join(map(repr, SEARCHED_SCHEDULES))}.")
        if self.cp_comm not in ("ring", "all_to_all"):
            raise ValueError(f"AutoLayout.cp_comm={self.cp_comm!r}: 'ring' or 'all_to_all'.")
        if self.loss_chunks is not None and (not self.loss_chunks or any(
                c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1) for c in self.loss_chunks)):
            raise ValueError(f"AutoLayout.loss_chunks={self.loss_chunks!r}: positive numbers of positions (or None: "
                             f"the whole sequence), e.g. (4096, 1024, None); None for the strategy's loss_chunk only.")
        if not isinstance(self.cache, (bool, str)) or self.cache == "":
            raise ValueError(f"AutoLayout.cache={self.cache!r}: True (the planner's cache directory), a directory, or "
                             f"False (none).")
        if self.zero not in (0, 1):
            raise ValueError(f"AutoLayout.zero={self.zero!r}: 0 or 1 (the optimizer state sharded over data-parallel "
                             f"ranks).")
        if self.calibration is not None:  # refused here, in the user's script, before any rank starts
            self.rates()

    def fits(self) -> Any:
        """The probes' cache the planner fills (:class:`~lightning_seqpar.plan.measuring.fit_cache.FitCache` on
        ``cache``'s directory, or a dict of this run's)."""
        if self.cache is False:
            return {}
        from pathlib import Path

        from lightning_seqpar.plan.measuring.fit_cache import FitCache, default_cache_directory

        return FitCache(default_cache_directory() if self.cache is True else Path(self.cache))

    def rates(self) -> Any:
        """The :class:`~lightning_seqpar.plan.StepCalibration` read from ``calibration``, or ``None``."""
        from lightning_seqpar.plan.measuring.calibration import StepCalibration

        return StepCalibration.load(self.calibration) if self.calibration is not None else None


def auto_layout_of(layout: Union[None, str, AutoLayout, dict], tp: Any, pp: int, cp: int = 1) -> Optional[AutoLayout]:
    """The strategy's ``layout`` argument as an :class:`AutoLayout` (``None``: no planner asked).

    Raises:
        ValueError: ``layout="auto"`` or ``tp="auto"`` without the run's shapes (the fix:
            ``layout=AutoLayout(seq_len=..., batch_size=...)``: Lightning sets up the data after the process groups),
            an unknown ``layout``, ``tp``/``pp`` given with it.
    """
    if layout is None and tp == "auto":
        layout = "auto"  # the same request, spelled on tp
        tp = 1
    if layout is None:
        return None
    if layout == "auto":
        raise ValueError("layout='auto' (or tp='auto') plans for the run's shapes, which Lightning sets up only after the "
                         "process groups exist: pass layout=AutoLayout(seq_len=S, batch_size=B) (B: the train loader's "
                         "batch size, per data-parallel rank); recipe: strategy=auto.")
    if isinstance(layout, dict):
        layout = AutoLayout(**{k: tuple(v) if k in ("micro_batches", "context_parallel", "schedules", "loss_chunks")
                                  and v is not None else v
                               for k, v in layout.items()})
    if not isinstance(layout, AutoLayout):
        raise ValueError(f"layout={layout!r}: None (tp and pp as given) or AutoLayout(seq_len=..., batch_size=...).")
    if tp != 1 or pp != 1:
        raise ValueError(f"layout=AutoLayout(...) chooses tp and pp; got tp={tp}, pp={pp} as well: leave them out.")
    if cp != 1:
        raise ValueError(f"layout=AutoLayout(...) chooses cp; got cp={cp} as well: leave it out, or bound the search "
                         f"with AutoLayout(..., context_parallel=({cp},)).")
    return layout


def check_world(auto: Optional[AutoLayout], layout: Any, world: int) -> None:
    """A world of ``world`` processes splits into ``layout`` (nothing to check under ``layout=AutoLayout``, which
    chooses the layout for the world).

    Raises:
        ValueError: from :meth:`~lightning_seqpar.layout.Layout.dims`.
    """
    if auto is None:
        layout.dims(world)


def hf_model_in(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The Hugging Face causal LM inside ``module`` (a model with a ``config`` and input embeddings)."""
    for candidate in module.modules():
        if hasattr(getattr(candidate, "config", None), "model_type") and hasattr(candidate, "get_input_embeddings"):
            return candidate
    return None


def declared_plan_config(module: torch.nn.Module) -> Optional[dict]:
    """The Hugging Face config dict a model inside ``module`` declares it is planned as: its ``config``'s
    ``planned_config()`` (the reference GPT's: GPT-2 of its sizes, :meth:`~lightning_seqpar.models.GPTConfig.planned_config`),
    or ``None``.

    Raises:
        ValueError: from ``planned_config()``, a model that cannot be planned as declared (naming why).
    """
    for candidate in module.modules():
        declare = getattr(getattr(candidate, "config", None), "planned_config", None)
        if callable(declare):
            return declare()
    return None


def planned_loss_chunk(module: torch.nn.Module, layout: Any) -> Optional[int]:
    """The ``loss_chunk`` the planner prices ``module``'s run with: the layout's (``layout.loss_chunk``, a Hugging
    Face model's head and loss rewritten to compute the logits that many positions at a time), ``None`` for a model
    priced by declaration (the reference GPT), whose own loss computes its logits whole.

    Raises:
        ValueError: as :func:`declared_plan_config`.
    """
    return None if declared_plan_config(module) is not None else layout.loss_chunk


def planned_model(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The model the planner prices for ``module``: its Hugging Face causal LM, else the one its model declares
    (:func:`declared_plan_config`) built on the meta device; ``None``: neither.

    Raises:
        ValueError: as :func:`declared_plan_config`.
        ImportError: a declared model without the ``[hf]`` extra (the planner builds its declaration with
            transformers), naming the extra.
    """
    from lightning_seqpar.extras import require_extra
    from lightning_seqpar.plan.measuring.models import meta_model

    model = hf_model_in(module)
    if model is not None:
        return model
    config = declared_plan_config(module)
    if config is None:
        return None
    require_extra("hf", f"Planning {type(module).__name__} (priced as the Hugging Face {config['model_type']} of its "
                        f"sizes)")
    return meta_model(config)


def _memory(auto: AutoLayout, device: torch.device) -> float:
    if auto.memory_budget is not None:
        return float(auto.memory_budget)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    raise ValueError(f"AutoLayout(memory_budget=None) reads the CUDA device's memory; on {device.type} give "
                     f"memory_budget=BYTES per device.")


@dataclass(frozen=True)
class LayoutChoice:
    """What ``layout=AutoLayout(...)`` chose, made once (rank 0, or the launching process) and sent to every rank.

    Attributes:
        record: the planner's :class:`~lightning_seqpar.plan.LayoutRecord` of the chosen layout (its predictions).
        layout: the chosen :class:`~lightning_seqpar.Layout` (``record.layout``).
    """

    record: Any

    @property
    def layout(self) -> Any:
        return self.record.layout


def choose_layout(auto: AutoLayout, module: Any, trainer: Any, base: Any, *, world: int, gpus_per_node: int,
                  device: torch.device, sharded_context: Any, compiled: bool = False) -> LayoutChoice:
    """Choose a layout (see the module docstring) for ``module`` trained by ``trainer`` on ``world`` processes, from
    ``base`` (the strategy's :class:`~lightning_seqpar.Layout` before the choice: its ``ep`` and ``expert_tp``
    bound the search when above 1), for the caller to
    apply. The planner probes layers on emulated ranks (CPU seconds): one process chooses, the others receive it.

    Args:
        sharded_context: the strategy's ``model_sharded_context`` (a module whose model is built in
            ``configure_model`` is built under it, on the meta device).
        compiled: the run compiles its blocks (``compile=True``): schedules that split the backward are not searched.

    Raises:
        ValueError: a model the planner does not know (neither a Hugging Face causal LM nor one declaring
            ``planned_config()``) or refuses, a device memory to read that cannot be read, or
            no layout that fits (naming the smallest world and the longest sequence that would).
    """
    from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
    from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute
    from lightning_seqpar.plan import inventory_of_hf_model

    from lightning_seqpar.lightning.declared_model import model_for_checks

    model = planned_model(module)
    if model is None:  # built in configure_model: as declared, on the meta device, the module left as it was
        built = model_for_checks(module, sharded_context)
        model = planned_model(built) if built is not None else None
    if model is None:
        raise ValueError(f"layout=AutoLayout(...) plans Hugging Face causal LMs and models whose config declares "
                         f"planned_config() (the reference GPT); {type(module).__name__} holds neither. Give tp and pp "
                         f"(python -m lightning_seqpar.plan helps choose them).")
    existing = [c for c in trainer.callbacks if isinstance(c, SelectiveRecompute)]
    offloading = any(isinstance(c, ActivationOffload) for c in trainer.callbacks)
    kinds = frozenset({c.granularity for c in existing} & {"none", "selective", "full"})
    memory = _memory(auto, device)
    inventory = inventory_of_hf_model(model)
    schedules = tuple(s for s in auto.schedules if not (compiled and splits_backward(s))) or ("1F1B",)
    loss_chunk = planned_loss_chunk(module, base)
    if loss_chunk is not None and auto.loss_chunks is not None:  # a Hugging Face model's: searched
        loss_chunk = tuple(dict.fromkeys(auto.loss_chunks))
    options = dict(precision=str(trainer.precision), zero=auto.zero, recompute=kinds, gpus_per_node=gpus_per_node,
                   fits=auto.fits(),
                   ep=base.ep if base.ep > 1 else None,
                   expert_tp=base.expert_tp if base.expert_tp > 1 else None, schedules=schedules,
                   memory_choices=auto.memory_choices and not existing and not offloading, loss_chunk=loss_chunk)
    ranked = rank_layouts(inventory, world, auto.seq_len, auto, memory, **options)
    if not ranked:
        raise ValueError(_nothing_fits(inventory, world, auto, memory, options))
    best = ranked[0]
    runner_up = ranked[1] if len(ranked) > 1 else None
    rank_zero_info(f"layout=auto chose {_describe(best)}: the fastest predicted step of the {len(ranked)} layouts that "
                   f"fit {auto.headroom:g} × {_size(memory)} per device; runner-up: "
                   f"{_describe(runner_up) if runner_up else 'none'}. To train with it without planning again: "
                   f"layout={best.layout}, or in a recipe: {best.layout.overrides()}")
    return LayoutChoice(best)


def _describe(record: Any) -> str:
    return (f"{record.layout} (dp={record.dp}, micro_batch={record.micro_batch}): {_size(record.bytes['total'])} on "
            f"stage {record.stage} ({', '.join(f'{k} {_size(v)}' for k, v in record.bytes.items() if k != 'total')}), "
            f"step {record.step_time['total']:.3g} s ({record.timing})")


def _size(n: float) -> str:
    return next(f"{n / scale:.3g} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                if n >= scale or scale == 1)


def rank_layouts(inventory: Any, world: int, seq_len: int, auto: AutoLayout, memory: float, *, precision: str,
                 zero: int = 0, recompute: frozenset = frozenset(), gpus_per_node: int = 8,
                 fits: Optional[dict] = None, ep: Optional[int] = None, expert_tp: Optional[int] = None,
                 schedules: Optional[tuple[str, ...]] = None, memory_choices: bool = False,
                 loss_chunk: Union[Optional[int], tuple[Optional[int], ...]] = 4096) -> list[Any]:
    """The feasible layouts ``layout=auto`` chooses from, best first (:func:`lightning_seqpar.plan.plan`'s records):
    the context-parallel sizes and communication of ``auto``, the loader's ``auto.batch_size`` per data-parallel rank
    (a global batch of ``batch_size × dp``), micro-batches
    splitting it under a pipeline (the whole batch without one), ``zero`` as given, the recomputation among
    ``recompute`` (any when empty), the expert-parallel size ``ep`` and expert tensor-parallel size ``expert_tp``
    (any when ``None``), the pipeline ``schedules`` (``None``: ``auto.schedules``); with ``memory_choices``, layouts that trade recomputation by
    module or activation offload for memory too; ``loss_chunk``: the run's (the strategy's ``loss_chunk``, ``None``
    where the model's own loss computes its logits whole), or a tuple of them to search."""
    from lightning_seqpar.plan import Hardware, plan

    records = plan(inventory, world, seq_len, auto.batch_size, hardware=Hardware(memory=memory,
                   gpus_per_node=gpus_per_node, calibration=auto.rates()), precision=precision, headroom=auto.headroom,
                   micro_batches=auto.micro_batches, fits=fits, per_rank_batch=True,
                   context_parallel=auto.context_parallel, cp_comm=auto.cp_comm, schedule=schedules or auto.schedules,
                   memory_choices=memory_choices, loss_chunk=loss_chunk)
    return [r for r in records if r.feasible and r.layout.zero == zero
            and (not recompute or r.layout.recompute in recompute) and (ep is None or r.layout.ep == ep)
            and (expert_tp is None or r.layout.expert_tp == expert_tp)
            and (r.layout.pp > 1 or r.micro_batch == auto.batch_size)]  # no pipeline: the loader's whole batch


def _nothing_fits(inventory: Any, world: int, auto: AutoLayout, memory: float, options: dict) -> str:
    more = next((w for w in (2 * world, 4 * world, 8 * world, 16 * world)
                 if rank_layouts(inventory, w, auto.seq_len, auto, memory, **options)), None)
    s = auto.seq_len // 2
    while s >= 1 and not rank_layouts(inventory, world, s, auto, memory, **options):
        s //= 2
    return (f"layout=auto: no layout of this model fits {auto.headroom:g} × {memory / 1e9:g} GB per device on {world} "
            f"devices at seq_len={auto.seq_len}, batch_size={auto.batch_size}. The smallest that would fit: "
            + (f"{more} devices" if more else f"more than {16 * world} devices")
            + (f", or seq_len={s} on {world}." if s >= 1 else "; no shorter sequence fits either."))
