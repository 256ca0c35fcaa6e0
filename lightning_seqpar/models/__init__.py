"""Reference models written as ordinary single-device PyTorch."""

from lightning_seqpar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
