"""A module's model as every rank will build it, for what the launching process checks and plans before any rank
starts (the layout's static checks, ``layout=AutoLayout(...)``).

A LightningModule that builds its model in ``configure_model`` usually needs its trainer there (the strategy to read
pretrained weights into the shards, ``ckpt_path`` to know a resume), which the launching process does not have yet,
and building it there has effects (weights registered with the strategy). Such a module declares its model instead:
``declared_model()`` returns the single-device model ``configure_model`` builds (wrapped as it wraps it: PEFT's LoRA
included), built without the trainer and without reading weights; it is called on the meta device, so nothing is
allocated. The library's modules declare theirs (:class:`~lightning_seqpar.models.GPTLightningModule`,
:class:`~lightning_seqpar.models.HFCausalLMModule`, :class:`~lightning_seqpar.models.finetune.FineTuneModule`); for
any other, ``configure_model`` is tried on a copy of the module, and one that needs what the launching process lacks
is left to the ranks, which check it when they build it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

import torch.nn as nn


@runtime_checkable
class DeclaresModel(Protocol):
    """A LightningModule that can say which model its ``configure_model`` builds (see the module docstring)."""

    def declared_model(self) -> nn.Module:
        """The single-device model ``configure_model`` builds, without the trainer and without reading weights."""
        ...


def model_for_checks(module: Any, sharded_context: Callable[[], ContextManager[None]]) -> Optional[nn.Module]:
    """``module`` itself when it builds its model in ``__init__``; else its model built under ``sharded_context``
    (the strategy's meta-device context) from :meth:`DeclaresModel.declared_model`, or from ``configure_model`` on a
    copy of ``module``; ``None`` when that cannot run before the ranks start (the ranks check it). ``module`` is left
    as it was."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(module, nn.Module):
        return None
    if not isinstance(module, LightningModule) or not is_overridden("configure_model", module):
        return module  # built in __init__
    if isinstance(module, DeclaresModel):
        with sharded_context():
            return module.declared_model()
    try:
        candidate = copy.deepcopy(module)
        with sharded_context():
            candidate.configure_model()
    except Exception:  # noqa: BLE001 - e.g. it reads self.trainer, or holds what cannot be copied: the ranks check it
        return None
    return candidate
