"""Policies: how one block class becomes its tensor + sequence parallel version."""

from __future__ import annotations

from typing import ClassVar

import torch.nn as nn

from lightning_seqpar.rewrite.context import RewriteContext


class Policy:
    """Rewrites instances of one block class.

    Subclass it, set :attr:`block` and :attr:`role`, and implement :meth:`check`, :meth:`describe`
    and :meth:`rewrite`; pass instances to ``SeqParallelStrategy(policies=[...])``.

    Attributes:
        block: the exact class this policy handles (subclasses need their own policy, since they may
            change ``forward``).
        role: ``"layer"`` for a transformer layer whose input and output are ``[s/t, b, h]`` between
            rewritten neighbours (consecutive layers in an ``nn.ModuleList``/``nn.Sequential`` share
            one parallel region); ``"stack"`` for a module that opens and closes its own region.
    """

    block: ClassVar[type[nn.Module]]
    role: ClassVar[str] = "layer"

    def check(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` and the numbers if ``module`` cannot be split t ways."""
        raise NotImplementedError

    def describe(self, module: nn.Module, ctx: RewriteContext) -> str:
        """One line saying what the rewrite does to ``module``."""
        raise NotImplementedError

    def rewrite(self, module: nn.Module, ctx: RewriteContext, *, enter_region: bool, exit_region: bool) -> nn.Module:
        """Return the parallel replacement of ``module`` (weights sliced from it)."""
        raise NotImplementedError


def require_divisible(name: str, what: str, value: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``value`` is divisible by ``tp``."""
    if value % tp:
        raise ValueError(
            f"{name}: {what} = {value} is not divisible by the tensor-parallel size tp = {tp}. "
            f"Choose tp among the divisors of {value}, or change the model's {what}."
        )
