"""A LightningModule that trains the reference GPT: what a user would write for one device."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.optim.muon import Muon


class ExpOfMean(MeanMetric):
    """``exp`` of the mean of the values seen: perplexity from per-batch mean losses."""

    def compute(self) -> Tensor:
        return torch.exp(super().compute())


class CausalLMModule(pl.LightningModule):
    """Language-model training with AdamW and a warmup + cosine learning-rate schedule; subclasses build the
    model and say how to compute the loss (:meth:`loss`).

    Logs ``train/loss`` and ``train/ppl`` every step, ``val/loss`` and ``val/ppl`` (torchmetrics means,
    synchronized across processes) every validation. Batches are ``(x, y)`` token ids ``[b, s]``, ``y`` being
    ``x`` shifted by one (nanoGPT's convention, :class:`~lightning_seqpar.data.TextDataModule`).

    Args:
        learning_rate: peak learning rate.
        weight_decay: AdamW weight decay on matrices (not on biases, norms, embeddings of size 1-D).
        warmup_steps: linear warmup steps.
        max_steps: total steps of the cosine decay (``None``: constant after warmup).
        min_lr_ratio: final learning rate as a fraction of the peak.
        optimizer: ``"adamw"``, or ``"muon"``: :class:`~lightning_seqpar.optim.Muon` over the layers' matrices (its
            learning rate adjusted to AdamW's update size, Moonlight's ``match_rms_adamw``, so that the same
            ``learning_rate`` and ``weight_decay`` serve both) and AdamW over the rest.

    Raises:
        ValueError: an optimizer other than those two.
    """

    OPTIMIZERS = ("adamw", "muon")

    def __init__(self, learning_rate: float = 1e-3, weight_decay: float = 0.1, warmup_steps: int = 0,
                 max_steps: Optional[int] = None, min_lr_ratio: float = 0.1, optimizer: str = "adamw") -> None:
        super().__init__()
        if optimizer not in self.OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: one of {list(self.OPTIMIZERS)} (optim.name in the recipes).")
        self.optimization = {"learning_rate": learning_rate, "weight_decay": weight_decay,
                             "warmup_steps": warmup_steps, "max_steps": max_steps, "min_lr_ratio": min_lr_ratio,
                             "optimizer": optimizer}
        self.val_loss = MeanMetric()
        self.val_ppl = ExpOfMean()

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean cross entropy of predicting ``y`` from ``x``."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> Optional[int]:
        """The model's vocabulary (v): token ids must be below it. The data module checks its corpus against it."""
        return None

    @property
    def tokenizer_path(self) -> Optional[str]:
        """The directory of the model's own tokenizer, when it has one."""
        return None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(*batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/ppl", torch.exp(loss.detach()), sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self.loss(*batch)
        self.val_loss.update(loss)
        self.val_ppl.update(loss)

    def on_validation_epoch_end(self) -> None:
        # Metric objects: Lightning computes them (synchronized by torchmetrics) and resets them; a tensor
        # logged here would need sync_dist although every rank already holds the same value.
        for metric in (self.val_loss, self.val_ppl):
            if metric.update_count == 0:  # a pipeline stage before the last computes no loss: it adds weight 0
                metric.update(torch.zeros((), device=self.device), weight=0.0)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    def configure_optimizers(self) -> Any:
        hp = self.optimization
        trainable = [p for p in self.parameters() if p.requires_grad]  # frozen ones (LoRA's base) get no state
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        if hp["optimizer"] == "muon":
            chosen = {id(p) for p in Muon.matrices(self)}
            optimizer: torch.optim.Optimizer = Muon(
                [{"params": [p for p in decay if id(p) in chosen], "use_muon": True},
                 {"params": [p for p in decay if id(p) not in chosen], "use_muon": False},
                 {"params": no_decay, "use_muon": False, "weight_decay": 0.0}],
                lr=hp["learning_rate"], weight_decay=hp["weight_decay"], adjust_lr_fn="match_rms_adamw",
                adamw_betas=(0.9, 0.95))
        else:
            optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
                lr=hp["learning_rate"], betas=(0.9, 0.95),
            )
        warmup, total, floor = hp["warmup_steps"], hp["max_steps"], hp["min_lr_ratio"]

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not total:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GPTLightningModule(CausalLMModule):
    """Language-model training of :class:`GPT` (see :class:`CausalLMModule`).

    Args:
        model: a :class:`GPTConfig` or the dict of its fields.
        empty_init: build the GPT in ``configure_model()`` instead of here (see there).
        **optimization: :class:`CausalLMModule`'s arguments.
    """

    def __init__(
        self,
        model: Union[GPTConfig, dict],
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        empty_init: bool = False,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__(learning_rate, weight_decay, warmup_steps, max_steps, min_lr_ratio, optimizer)
        config = model if isinstance(model, GPTConfig) else GPTConfig(**model)
        self.config, self.empty_init = config, empty_init
        self.save_hyperparameters({"model": asdict(config), **self.optimization})
        if not empty_init:
            self.gpt = GPT(config)

    def configure_model(self) -> None:
        """With ``empty_init``: build the GPT here, where the strategy makes it on the meta device (Lightning's
        convention for models larger than one device); the strategy then materializes only this rank's shards."""
        if self.empty_init and not hasattr(self, "gpt"):
            self.gpt = GPT(self.config)

    def declared_model(self) -> GPT:
        """The GPT ``configure_model`` builds (:class:`~lightning_seqpar.lightning.declared_model.DeclaresModel`)."""
        return GPT(self.config)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``[b, s, v]`` of token ids ``[b, s]``."""
        return self.gpt(idx)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return self.gpt(x, y)
