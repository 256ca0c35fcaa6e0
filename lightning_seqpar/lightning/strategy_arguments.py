"""The strategy's arguments as values: the layout from ``layout=`` and the size shorthands, and the refusal of the
keywords that moved into :class:`~lightning_seqpar.Layout` and the settings objects (no alias is kept beside them)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from lightning_seqpar.layout import Layout
from lightning_seqpar.lightning.auto_layout import AutoLayout, auto_layout_of

_LAYOUT = "layout=Layout({0}=...) (recipes: strategy.layout.{0})"
MOVED = {
    **{name: _LAYOUT.format(name) for name in (
        "num_microbatches", "schedule", "virtual_stages", "pipeline_split", "sequence_parallel", "loss_parallel",
        "expert_tp", "moe", "cp_comm", "loss_chunk", "zero", "fp32_main_params")},
    "parallel": "layout=Layout(...) (ParallelConfig's fields, the pipeline's flat)",
    "data_parallel": "layout=Layout(zero=..., fp32_main_params=...)",
    "checkpoint_format": "checkpointing=CheckpointConfig(format=...) (recipes: strategy.checkpointing.format)",
    "async_save": "checkpointing=CheckpointConfig(async_save=...)",
    "allow_non_finite_checkpoint": "checkpointing=CheckpointConfig(allow_non_finite=...)",
    "allow_unverified_checkpoint": "checkpointing=CheckpointConfig(allow_unverified=...)",
    "low_precision_residual": "precision_config=PrecisionConfig(low_precision_residual=...)",
    "policies": "rewriting=RewriteConfig(policies=[...])",
    "verify_rewrite": "rewriting=RewriteConfig(verify=...)",
    "compile": "rewriting=RewriteConfig(compile=...) (recipes: strategy.rewriting.compile)",
    "start_method": "launch=LaunchConfig(start_method=...) (recipes: strategy.launch.start_method)",
    "timeout": "launch=LaunchConfig(timeout=...) (recipes: strategy.launch.timeout)",
    "process_group_backend": "launch=LaunchConfig(backend=...)",
}
"""Each keyword the strategy took before its layout was one value, and where it lives now."""


def refuse_moved(given: Mapping[str, Any]) -> None:
    """Refuse keywords the strategy does not take, naming where each moved.

    Raises:
        TypeError: a keyword of :data:`MOVED` (naming its new place) or an unknown one.
    """
    if not given:
        return
    moved = [f"{name}= is now {MOVED[name]}" for name in given if name in MOVED]
    unknown = sorted(set(given) - set(MOVED))
    raise TypeError("SeqParallelStrategy: " + "; ".join(moved + ([f"unknown keyword(s) {unknown}"] if unknown else []))
                    + ".")


def layout_of(layout: Union[None, str, Layout, AutoLayout, Mapping[str, Any]], tp: Any = 1, pp: int = 1, cp: int = 1,
              ep: int = 1) -> tuple[Layout, Optional[AutoLayout]]:
    """The strategy's ``layout`` and size shorthands as ``(Layout, AutoLayout or None)``.

    A shorthand set away from 1 fills the layout's field, which must then be 1 or the same. Under ``AutoLayout`` the
    layout is a placeholder until the planner chooses (:func:`~.auto_layout.choose_layout`): ``ep`` bounds its search,
    ``tp``, ``pp``, ``cp`` are refused. A mapping is a recipe's: ``AutoLayout``'s fields when it has ``seq_len``,
    else ``Layout``'s.

    Raises:
        ValueError: a size given twice with two values; from :class:`Layout`, :class:`~.auto_layout.AutoLayout` and
            :func:`~.auto_layout.auto_layout_of`; a ``layout`` of another type.
    """
    if isinstance(layout, Mapping):
        layout = dict(layout)
        layout = layout if "seq_len" in layout else Layout(**layout)
    if layout is None and tp != "auto" or isinstance(layout, Layout):
        sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
        base = layout or Layout()
        twice = [f"{k}={v} and layout.{k}={getattr(base, k)}" for k, v in sizes.items()
                 if v != 1 and getattr(base, k) not in (1, v)]
        if twice:
            raise ValueError(f"{', '.join(twice)}: give each size once, as the shorthand or in the Layout.")
        return base.replace(**{k: v for k, v in sizes.items() if v != 1}), None
    auto = auto_layout_of(layout, tp, pp, cp)
    if auto is None:
        raise ValueError(f"layout={layout!r}: a Layout(...), an AutoLayout(seq_len=..., batch_size=...) or None.")
    return Layout(ep=ep, zero=auto.zero), auto  # a placeholder: ep bounds the search, zero is checked now
