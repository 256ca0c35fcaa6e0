"""A GPT in the nanoGPT manner: ordinary single-device code that the strategy rewrites.

Token + learned position embeddings, ``n_layer`` pre-LN blocks with an explicit
:class:`~lightning_seqpar.transformer.core_attention.CoreAttention`, a final LayerNorm and an LM head
(tied to the token embedding or not) — the architecture of Korthikanti et al. 2022 §3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.models.gpt_moe import Experts, MoEMLP, TopKRouter, router_losses
from lightning_seqpar.models.sampling import Sampling
from lightning_seqpar.transformer.core_attention import CoreAttention

if TYPE_CHECKING:
    from lightning_seqpar.rewriting.policy import Policy


@dataclass
class GPTConfig:
    """Shape and regularization of a :class:`GPT`.

    Raises:
        ValueError: ``experts_per_token`` outside ``1..n_experts`` for a mixture; an unknown ``aux_loss_type``.
    """

    vocab_size: int = 256
    """v: vocabulary size (256 for byte-level text)."""
    block_size: int = 256
    """s: the longest sequence (position-embedding rows)."""
    n_layer: int = 4
    """L: transformer layers."""
    n_head: int = 4
    """a: attention heads."""
    n_embd: int = 128
    """h: hidden size."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; ``None`` means 4h."""
    dropout: float = 0.0
    """Dropout after the embeddings, on attention probabilities, and after attention and MLP."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms."""
    tie_weights: bool = True
    """Share the token embedding with the LM head (as in the paper)."""
    label_smoothing: float = 0.0
    """ε of the training loss."""
    n_experts: int = 0
    """E: each layer's MLP a mixture of E experts (0: a dense MLP)."""
    experts_per_token: int = 2
    """k: the experts each token is routed to (softmax top-k, renormalized)."""
    expert_ffn_hidden_size: Optional[int] = None
    """f: each expert's width; ``None`` means 4h / k (the dense MLP's FLOPs per token)."""
    aux_loss_coef: float = 0.0
    """the Switch load-balancing loss's coefficient, added to the training loss."""
    aux_loss_type: str = "pooled"
    """``"pooled"``: one loss of every layer's counts and probabilities (transformers'); ``"per_layer"``: each layer's
    loss, summed (Megatron-Core's, Switch Transformer's)."""
    z_loss_coef: float = 0.0
    """the router z-loss's coefficient (ST-MoE), each layer's mean ``logsumexp(logits)²`` summed over the layers."""

    def __post_init__(self) -> None:
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} with n_experts={self.n_experts}: each token "
                             f"is routed to 1..{self.n_experts} experts.")
        if self.aux_loss_type not in ("pooled", "per_layer"):
            raise ValueError(f"aux_loss_type={self.aux_loss_type!r}: 'pooled' (transformers') or 'per_layer' "
                             f"(Megatron-Core's).")

    def planned_config(self) -> dict:
        """The Hugging Face config dict the planner prices this model as (``layout=AutoLayout(...)``,
        :class:`~lightning_seqpar.lightning.callbacks.LayoutReport`): GPT-2 of these sizes. Its parameters are these
        one for one (GPT-2's ``Conv1D`` weights are these ``Linear`` weights transposed), so model-state bytes are
        exact; its eager attention, exact GELU and dropout keep the tensors this model's layers keep.

        Raises:
            ValueError: a mixture of experts (``n_experts > 0``: GPT-2 has no mixture to price it as) or
                ``bias=False`` (GPT-2's layers always have biases), naming the fix: give ``tp``/``pp``/``ep``.
        """
        from lightning_seqpar.plan.measuring.models import gpt2_config

        unlike = ("n_experts > 0 (GPT-2 has no mixture of experts)" if self.n_experts else
                  "bias=False (GPT-2's layers always have biases)" if not self.bias else None)
        if unlike is not None:
            raise ValueError(f"The planner prices the reference GPT as the GPT-2 of its sizes; this one has {unlike}. "
                             f"Give SeqParallelStrategy tp, pp (and ep) yourself; python -m lightning_seqpar.plan "
                             f"prices a Hugging Face config.")
        return gpt2_config(vocab_size=self.vocab_size, n_positions=self.block_size, n_embd=self.n_embd,
                           n_head=self.n_head, n_layer=self.n_layer, n_inner=self.ffn_hidden_size,
                           tie_word_embeddings=self.tie_weights, activation_function="gelu", attn_pdrop=self.dropout,
                           resid_pdrop=self.dropout, embd_pdrop=self.dropout,
                           bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 lies outside a smaller vocabulary

    @property
    def output_router_logits(self) -> bool:
        """Whether the loss reads every layer's router logits (transformers' name for it): a load-balancing or z-loss."""
        return self.n_experts > 0 and (self.aux_loss_coef > 0 or self.z_loss_coef > 0)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection. ``[b, s, h]`` → ``[b, s, h]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.core_attention = CoreAttention(config.dropout, causal=True)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)  # each (b, s, h)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))  # (b, a, s, d)
        y = self.core_attention(q, k, v)  # (b, a, s, d)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``h → ffn → h`` with GeLU. ``[b, s, h]`` → ``[b, s, h]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        ffn = config.ffn_hidden_size or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, ffn, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(ffn, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer layer. ``[b, s, h]`` → ``[b, s, h]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoEMLP(config) if config.n_experts else MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Sampling, nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx)`` returns logits ``[b, s, v]``; ``forward(idx, targets)`` returns the mean
    cross-entropy loss (targets equal to -1 are ignored).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def parallel_policy(cls) -> "Policy":
        """The :class:`~lightning_seqpar.Policy` that rewrites this model (found by the rewrite, see
        :class:`~lightning_seqpar.rewriting.policy.DeclaresPolicy`)."""
        # Imported when asked: the policy's module imports the parallel version, which this module need not load.
        from lightning_seqpar.models.gpt_policy import GPTPolicy

        return GPTPolicy(cls)

    @staticmethod
    def init_module(module: nn.Module, name: str, n_layer: int) -> None:
        """Initialize ``module``'s own parameters as this model's constructor does (GPT-2's scheme): normal(0,
        0.02) Linear and Embedding weights, zero biases, LayerNorm ones/zeros, and std ``0.02/√(2L)`` for the
        residual projections ``c_proj``. Used to materialize a model built on the meta device."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, (TopKRouter, Experts)):
            for param in module.parameters(recurse=False):
                nn.init.normal_(param, mean=0.0, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, (TopKRouter, Experts)):
            for param in module.parameters(recurse=False):
                nn.init.normal_(param, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        b, s = idx.shape
        if s > self.config.block_size:
            raise ValueError(f"Sequence length {s} exceeds block_size {self.config.block_size}.")
        pos = torch.arange(s, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (b, s, h)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (b, s, v)
        if targets is None:
            return logits
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax of 16-bit logits loses the loss's precision
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=-1,
            label_smoothing=self.config.label_smoothing,
        )
        return loss + self.load_balancing_loss() if self.config.output_router_logits else loss

    def load_balancing_loss(self) -> Tensor:
        """The router losses of this forward's router logits (:func:`~.gpt_moe.router_losses`: the load-balancing
        loss and the z-loss, over every rank's tokens once rewritten)."""
        return router_losses(self.config, tuple(m.last_logits for m in self.modules() if isinstance(m, TopKRouter)))
