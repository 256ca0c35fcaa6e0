"""Reference models written as ordinary single-device PyTorch."""

from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.models.hf_module import HFCausalLMModule
from lightning_seqpar.models.module import CausalLMModule, GPTLightningModule

__all__ = ["GPT", "CausalLMModule", "GPTConfig", "GPTLightningModule", "HFCausalLMModule"]
