"""Tiny Hugging Face causal LMs (random init, built from a config: nothing is downloaded)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from tests.helpers.models import SEQ, VOCAB


class HFCausalLM(pl.LightningModule):
    """A user's module around ``AutoModelForCausalLM.from_config``: the loss from ``labels=`` (Hugging Face shifts
    the labels inside the model) or a hand-written cross entropy on the returned logits."""

    def __init__(self, family: str = "llama", attn_implementation: str = "eager", labels: bool = False,
                 kv_heads: int = 2, bias: bool = False, tie: bool = False, layers: int = 2) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

        common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=2 * SEQ,
                      tie_word_embeddings=tie, attn_implementation=attn_implementation)
        if family == "llama":
            config = LlamaConfig(attention_bias=bias, **common)
        elif family == "gpt2":  # fused c_attn, Conv1D weights [in, out], learned positions, tied LM head
            config = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=layers, n_head=4,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                attn_implementation=attn_implementation)
        else:
            config = Qwen2Config(**common)
        self.model = AutoModelForCausalLM.from_config(config)
        self.labels = labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits  # [b, s, v], batch-first as on one device

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.labels:
            return self.model(input_ids=x, labels=y, use_cache=False).loss
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(*batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.compute_loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
