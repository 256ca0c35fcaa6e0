"""The auxiliary-loss-free load balancing of DeepSeek-V3 (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
Strategy for Mixture-of-Experts"): after each optimizer step, every router's expert correction bias moves by ``u``
towards balance, ``b_e += u · sign(mean load − load_e)``, with ``load_e`` the (token, expert) choices expert e got in
the step.

transformers keeps the bias (``e_score_correction_bias``: GLM-4.5, DeepSeek-V3) as a buffer it never updates, so
training with it frozen is what one process does without this callback. With it, the counts are taken where the router
runs, on each rank's own tokens, and summed over the ranks that split the tokens (the groups the parallel block marks
its router logits with, :class:`~lightning_seqpar.moe.balancing.RouterTokens`), so every rank applies the one-process
update: one process with the same callback is the reference. Each token is counted once: a forward recomputed during
backward (activation recomputation) is not counted again. No host synchronisation.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar._compat import inside_backward
from lightning_seqpar.moe.balancing import MARK

BIAS = "e_score_correction_bias"
"""The buffer of the routers this updates (transformers' name)."""


class ExpertBiasUpdate(pl.Callback):
    """Updates every router's ``e_score_correction_bias`` by the aux-loss-free rule once per optimizer step.

    Args:
        rate: u, the step of the bias per optimizer step (DeepSeek-V3: 0.001).

    Raises:
        ValueError: at construction, ``rate`` not positive; when fitting starts, a model without any such router.
    """

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ValueError(f"ExpertBiasUpdate(rate={rate!r}): the bias step must be positive (DeepSeek-V3: 0.001).")
        self.rate = rate
        self._counts: dict[nn.Module, Tensor] = {}
        self._logits: dict[nn.Module, Tensor] = {}
        self._handles: list[Any] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        routers = [m for m in pl_module.modules() if isinstance(getattr(m, BIAS, None), Tensor)]
        if not routers:
            raise ValueError(f"ExpertBiasUpdate: the model has no router with an expert correction bias ({BIAS}: "
                             f"GLM-4.5, DeepSeek-V3); remove the callback.")
        for router in routers:
            self._handles.append(router.register_forward_hook(self._count))

    def _count(self, router: nn.Module, args: Any, output: Any) -> None:
        # A forward recomputed inside backward runs under a graph task: its tokens were counted already.
        if not router.training or inside_backward():
            return
        logits, _, chosen = output
        bias = getattr(router, BIAS)
        counts = self._counts.get(router)
        if counts is None:
            counts = self._counts[router] = torch.zeros(bias.shape[0], dtype=torch.float32, device=bias.device)
        counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float32, device=bias.device))
        self._logits[router] = logits  # the parallel block marks it once the router returns: read at the step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with torch.no_grad():
            for router, counts in self._counts.items():
                for group in getattr(getattr(self._logits.get(router), MARK, None), "groups", ()):
                    counts = group.all_reduce(counts)
                bias = getattr(router, BIAS)
                bias.add_((counts.mean() - counts).sign().to(bias.dtype), alpha=self.rate)
        self._counts.clear()
        self._logits.clear()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
