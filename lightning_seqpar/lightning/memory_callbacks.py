"""A layout's memory choices (recomputation, offload) and the run's callbacks, made to agree.

The recomputation and the offload are Lightning callbacks (:class:`~lightning_seqpar.SelectiveRecompute`,
:class:`~lightning_seqpar.ActivationOffload`); a :class:`~lightning_seqpar.Layout` names them too, so that the planner's
choice trains as priced and the strategy's layout says what the run does. :func:`layout_of_run` adds the callbacks a
layout names, or reads the run's own into the layout.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_seqpar.layout import Layout
from lightning_seqpar.memory.conflicts import BY_MODULE

Choices = tuple[str, tuple[str, ...], Optional[tuple[str, ...]]]


def run_memory_choices(callbacks: list) -> Optional[Choices]:
    """``(recompute, modules, offload)`` of the run's callbacks as a layout names them: the paper's granularity, the
    modules recomputed by module beside it, the modules offloaded (``None``: an offload planned from a budget at the
    first batch, not known yet); ``None`` when the run has neither callback. A recomputation planned from a budget
    (``granularity="auto"``) reads as ``"none"``: it is chosen at the first batch."""
    from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
    from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute

    recomputes = [c for c in callbacks if isinstance(c, SelectiveRecompute)]
    offloads = [c for c in callbacks if isinstance(c, ActivationOffload)]
    if not recomputes and not offloads:
        return None
    recompute, modules = "none", ()
    if recomputes and recomputes[0].modules is not None:
        names = recomputes[0].modules
        recompute = "full" if "full" in names else "selective" if "core_attn" in names else "none"
        modules = tuple(n for n in names if n in BY_MODULE)
    elif recomputes and recomputes[0].granularity in ("selective", "full"):
        recompute = recomputes[0].granularity
    offload = () if not offloads else None if offloads[0].modules is None else tuple(offloads[0].modules)
    return recompute, modules, offload


def memory_callbacks(layout: Layout) -> list:
    """The callbacks a run needs to train with ``layout``'s recomputation and offload (none when it names neither)."""
    from lightning_seqpar.lightning.callbacks.activation_offload import ActivationOffload
    from lightning_seqpar.lightning.callbacks.selective_recompute import SelectiveRecompute

    out: list = []
    if layout.recompute != "none" or layout.recompute_modules:
        base = {"selective": ["core_attn"], "full": ["full"], "none": []}[layout.recompute]
        out.append(SelectiveRecompute(modules=[*base, *layout.recompute_modules]) if layout.recompute_modules
                   else SelectiveRecompute(granularity=layout.recompute))
    if layout.offload:
        out.append(ActivationOffload(modules=list(layout.offload)))
    return out


def layout_of_run(layout: Layout, trainer: Any, chosen: bool) -> Layout:
    """``layout`` as the run trains it: a run without recomputation or offload callbacks gets those ``layout``
    names; a run with its own keeps them, and the layout takes their choices when it named none or was ``chosen`` by
    the planner within them (``AutoLayout`` bounds its search by the run's callbacks).

    Raises:
        ValueError: a layout naming recomputation or offload that the run's own callbacks contradict.
    """
    own = run_memory_choices(trainer.callbacks)
    named = (layout.recompute, layout.recompute_modules, layout.offload)
    if own is None:
        trainer.callbacks.extend(memory_callbacks(layout))
        return layout
    if not chosen and named != ("none", (), ()) and own != named:
        raise ValueError(f"Layout(recompute={layout.recompute!r}, recompute_modules={layout.recompute_modules!r}, "
                         f"offload={layout.offload!r}) with the run's own SelectiveRecompute/ActivationOffload "
                         f"callbacks choosing {own}: name the memory choices once, in the Layout or as callbacks.")
    return layout.replace(recompute=own[0], recompute_modules=own[1], offload=own[2] or ())
