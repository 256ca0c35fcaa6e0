"""A LightningModule that trains a Hugging Face causal LM: what a user would write for one device.

transformers is imported when the module is built (through :mod:`lightning_seqpar.hf.models`), never by
``import lightning_seqpar``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config, pretrained_state_dict
from lightning_seqpar.models.module import CausalLMModule


class HFCausalLMModule(CausalLMModule):
    """Training of ``AutoModelForCausalLM`` (held as ``self.model``) from a config or from pretrained weights.

    The model is built in :meth:`configure_model` (Lightning's convention for models larger than one device): under
    :class:`~lightning_seqpar.SeqParallelStrategy` it is made on the meta device and each rank materializes only its
    shards and pipeline stage, pretrained weights read straight into them (each rank its own rows of the
    safetensors files); on one device it is built and loaded as usual.

    Args:
        config: keyword arguments of the model's config, with ``model_type`` (e.g. ``"llama"``, ``"qwen2"``) —
            a model of random init; or ``None`` with ``pretrained``.
        pretrained: a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``). A run resumed
            from a checkpoint (``ckpt_path``) takes the checkpoint's weights instead.
        attn_implementation: ``"eager"`` (explicit core attention: selective recomputation applies) or ``"sdpa"``.
        **optimization: :class:`CausalLMModule`'s arguments.

    Raises:
        ValueError: neither or both of ``config`` and ``pretrained``.
    """

    def __init__(self, config: Optional[dict] = None, pretrained: Optional[str] = None,
                 attn_implementation: str = "eager", **optimization: Any) -> None:
        super().__init__(**optimization)
        self.hf_config = causal_lm_config(config, pretrained, attn_implementation)
        self.pretrained = pretrained
        self.save_hyperparameters({"config": self.hf_config.to_dict(), "pretrained": pretrained, **self.optimization})

    def declared_model(self) -> Any:
        """The causal LM ``configure_model`` builds, without its weights
        (:class:`~lightning_seqpar.lightning.declared_model.DeclaresModel`)."""
        return build_causal_lm(self.hf_config)

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        self.model = build_causal_lm(self.hf_config)
        if self.pretrained is None or self.trainer.ckpt_path is not None:  # a resumed run has its own weights
            return
        strategy = self.trainer.strategy
        if hasattr(strategy, "load_single_device_state_dict"):  # read into the shards when they are made
            strategy.load_single_device_state_dict(self.pretrained, prefix="model.")
        else:
            self.model.load_state_dict(pretrained_state_dict(self.pretrained))

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.pretrained

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``[b, s, v]`` of token ids ``[b, s]`` (full vocabulary, batch-first, as on one device)."""
        return self.model(input_ids=idx).logits

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean cross entropy of ``y`` given ``x`` (``[b, s]`` each, ``y`` already shifted), through the model's own
        loss (``labels=``, with ``shift_labels=y`` so every position counts): under tensor parallelism the
        vocabulary-parallel cross entropy, so no rank builds the ``[b, s, v]`` logits."""
        return self.model(input_ids=x, labels=y, shift_labels=y).loss
