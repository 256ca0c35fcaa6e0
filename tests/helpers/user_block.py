"""A user's own model whose block is written in nanoGPT's shape, and the few lines that declare it."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.rewriting.declared_policy import DeclaredBlockPolicy
from tests.helpers.models import SEQ, VOCAB


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# What a user writes to parallelize Block: which part is which.
BLOCK_SPEC = BlockSpec(
    attention_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn", attention_out="attn.c_proj", mlp_in="mlp.c_fc",
    mlp_out="mlp.c_proj", activation="mlp.gelu", num_heads="attn.n_head", attention_dropout="attn.attn_dropout",
    residual_dropouts=("attn.resid_dropout", "mlp.dropout"), attention="sdpa",
)
POLICY = DeclaredBlockPolicy(Block, BLOCK_SPEC)


class NanoLM(pl.LightningModule):
    def __init__(self, n_embd: int = 16, n_head: int = 4, n_layer: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(SEQ, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class NanoLMContextParallel(NanoLM):
    """The same model as a user writes it for context parallelism: its forward takes the tokens' positions and passes
    the layer arguments on to its blocks, and its step takes this cp rank's share of the batch (the same code runs on
    one device, where the share is the batch and there are no layer arguments)."""

    def forward(self, idx, positions=None, **layer_arguments):
        positions = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x, **layer_arguments)
        return self.lm_head(self.ln_f(x))

    def compute_loss(self, x, y):
        from lightning_seqpar import context_parallel_batch

        part = context_parallel_batch(self, x, labels=y)
        logits = self(part.input_ids, part.position_ids, **part.layer_arguments)
        return part.loss(F.cross_entropy(logits.reshape(-1, VOCAB), part.labels.reshape(-1), reduction="sum"))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(*batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss
