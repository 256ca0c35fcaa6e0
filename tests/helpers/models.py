"""Tiny LightningModules used by the multi-process tests, and their single-process references."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.checkpoint.full_state import full_gradients
from lightning_seqpar.checkpoint.stages import merge_over_stages
from lightning_seqpar.optim import DistributedOptimizer
from lightning_seqpar.models import GPTConfig, GPTLightningModule
from lightning_seqpar.parallel.placement import shard_spec

VOCAB, SEQ, BATCH = 13, 8, 2  # a vocabulary no tp in {2, 4} divides: exercises padding


class EncoderLM(pl.LightningModule):
    """A user's own model: embeddings, torch transformer layers, a head and a loss."""

    def __init__(self, container: str = "encoder", batch_first: bool = True, norm_first: bool = True,
                 activation: str = "gelu", masks: bool = True, dropout: float = 0.0, h: int = 16, heads: int = 4,
                 layers: int = 2, causal_hint: bool = False) -> None:
        super().__init__()
        self.batch_first, self.masks, self.causal_hint = batch_first, masks, causal_hint
        self.embed = nn.Embedding(VOCAB, h)
        self.pos = nn.Parameter(torch.randn(SEQ, h) * 0.1)
        make = lambda: nn.TransformerEncoderLayer(h, heads, 2 * h, dropout=dropout, activation=activation,  # noqa: E731
                                                  batch_first=batch_first, norm_first=norm_first)
        self.container = container
        if container == "encoder":
            self.encoder = nn.TransformerEncoder(make(), layers, norm=nn.LayerNorm(h), enable_nested_tensor=False)
        else:
            self.layers = nn.ModuleList([make() for _ in range(layers)])
        self.head = nn.Linear(h, VOCAB)

    def forward(self, x):
        b, s = x.shape
        hidden = self.embed(x) + self.pos[:s]  # [b, s, h]
        if not self.batch_first:
            hidden = hidden.transpose(0, 1)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1) if self.masks else None
        # Token 0 in the last two positions is padding: depends on the data, never masks a whole row.
        padding = (x == 0) & (torch.arange(s) >= s - 2)
        if self.container == "encoder":
            hidden = self.encoder(hidden, mask=causal, src_key_padding_mask=padding if self.masks else None,
                                  **({"is_causal": True} if self.causal_hint else {}))  # torch's documented hint
        else:
            for layer in self.layers:
                hidden = layer(hidden, src_mask=causal, is_causal=self.masks)
        if not self.batch_first:
            hidden = hidden.transpose(0, 1)
        return self.head(hidden)

    def training_step(self, batch, batch_idx):
        loss = compute_loss(self, *batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def compute_loss(module: pl.LightningModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if hasattr(module, "compute_loss"):
        return module.compute_loss(x, y)
    if isinstance(module, GPTLightningModule):
        return module.gpt(x, y)
    return F.cross_entropy(module(x).reshape(-1, VOCAB), y.reshape(-1))


def gpt_module(dropout: float = 0.0, tie_weights: bool = True, label_smoothing: float = 0.1,
               n_layer: int = 2, n_embd: int = 16, n_experts: int = 0, aux_loss_coef: float = 0.0,
               aux_loss_type: str = "pooled", z_loss_coef: float = 0.0, optimizer: str = "adamw"
               ) -> GPTLightningModule:
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=n_embd, dropout=dropout,
                       tie_weights=tie_weights, label_smoothing=label_smoothing, n_experts=n_experts,
                       aux_loss_coef=aux_loss_coef, aux_loss_type=aux_loss_type, z_loss_coef=z_loss_coef)
    return GPTLightningModule(config, learning_rate=1e-2, optimizer=optimizer)


def build(kind: str, **kwargs) -> pl.LightningModule:
    """Seeded: every process builds the same initial model."""
    torch.manual_seed(1234)
    if kind == "hf":
        from tests.helpers.hf_models import HFCausalLM

        return HFCausalLM(**kwargs)
    if kind == "nano":
        from tests.helpers.user_block import NanoLM

        return NanoLM(**kwargs)
    if kind == "nano_cp":
        from tests.helpers.user_block import NanoLMContextParallel

        return NanoLMContextParallel(**kwargs)
    return gpt_module(**kwargs) if kind == "gpt" else EncoderLM(**kwargs)


def token_data(steps: int, dp: int, seed: int = 0, batch: int = BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    n = steps * batch * dp
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    x[::3, -1] = 0  # some key padding for models that mask token 0
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, y)


def loader(dataset: TensorDataset, batch: int = BATCH) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=False)


@dataclass
class Recorder(pl.Callback):
    """Per optimizer step: the loss and the gradients the unparallelized model would hold."""

    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    replicated: list = field(default_factory=list)
    logged: list = field(default_factory=list)  # ``self.log("train/loss", sync_dist=True)`` as this rank sees it
    final_state: dict = field(default_factory=dict)  # the reference model's state dict after training
    p2p_bytes: dict = field(default_factory=dict)  # pipeline point-to-point payload bytes this rank sent, by kind

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        if isinstance(strategy, SeqParallelStrategy) and strategy.pipeline is not None:
            log = strategy.pipeline.executor.transport.log
            self.p2p_bytes = {kind: log.bytes(kind) for kind in ("activation", "gradient")}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.logged.append(trainer.callback_metrics["train/loss"].item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        strategy = trainer.strategy
        mesh = strategy.mesh if isinstance(strategy, SeqParallelStrategy) else None
        distributed = isinstance(getattr(optimizer, "optimizer", optimizer), DistributedOptimizer)
        # (this optimizer's parameters: a module may step several)
        own = [p for group in optimizer.param_groups for p in group["params"]]
        if distributed:  # zero=1: the gradients are the optimizer's element ranges; assembled for the comparison
            for p in own:
                g = optimizer.gathered_gradient(p)  # float32 under fp32 main params
                p.grad = None if g is None else g.to(p.dtype)
        self.grads.append(merge_over_stages(full_gradients(pl_module, mesh), mesh.pipeline) if mesh else
                          {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})
        self.replicated.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                                if p.grad is not None and shard_spec(p) is None})
        if distributed:
            for p in own:
                p.grad = None


def reference_run(module: pl.LightningModule, dataset: TensorDataset, steps: int, dp: int,
                  accumulate: int = 1, clip: Optional[float] = None, dtype: torch.dtype = torch.float64,
                  autocast: Optional[torch.dtype] = None, batch: int = BATCH) -> Recorder:
    """Single-process training on the same global batches the parallel run sees.

    Parameters in ``dtype`` (float64 by default); ``autocast`` runs forward passes under CPU autocast; ``batch``:
    samples per data-parallel rank and micro-step.
    """
    module = copy.deepcopy(module).to(dtype)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    record = Recorder()
    # Lightning gives each data-parallel rank DistributedSampler(shuffle=True, seed=0) indices.
    order = [list(DistributedSampler(dataset, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for micro in range(accumulate):
            k = step * accumulate + micro
            idx = [i for r in range(dp) for i in order[r][k * batch : (k + 1) * batch]]
            x, y = dataset.tensors[0][idx], dataset.tensors[1][idx]
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = compute_loss(module, x, y)
            (loss / accumulate).backward()
            losses.append(loss.item())
        record.losses.extend(losses)
        # Lightning's on_before_optimizer_step sees gradients before clipping; later steps see its effect.
        record.grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
    record.final_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return record
