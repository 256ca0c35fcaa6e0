"""Reference models written as ordinary single-device PyTorch."""

from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.models.module import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule"]
