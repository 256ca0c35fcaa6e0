"""A Hugging Face tokenizer as the data pipeline uses it (``transformers`` imported when one is loaded)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer.from_pretrained``). Documents are encoded without special tokens
    and separated by the end-of-text token (``eos_token``), as Megatron's and nanoGPT's preprocessing do.

    Raises:
        ValueError: a tokenizer without an end-of-text token.
    """

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer, self.name = tokenizer, name
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"The tokenizer {name} has no end-of-text token (eos_token) to separate documents with; "
                             f"set eos_token in its tokenizer_config.json.")
        self.separator = [int(eos)]
        self.vocab_size = len(tokenizer)
        self.identity = _identity(tokenizer)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text without special tokens (int64 arrays)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer itself: a batch is encoded on every core
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no character offsets
            return [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]
        return [np.asarray(ids, dtype=np.int64) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids beyond the tokenizer (a model's padded vocabulary) are left out."""
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size])

    def save_pretrained(self, directory: str) -> None:
        """Write the tokenizer's files into ``directory`` (for an exported model)."""
        self.tokenizer.save_pretrained(directory)


def _identity(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{state}".encode()).hexdigest()[:16]


def load_hf_tokenizer(spec: str, name: str) -> HFTokenizer:
    """``AutoTokenizer.from_pretrained(spec)`` as an :class:`HFTokenizer`.

    Raises:
        ImportError: without ``transformers``, with the install command.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError("A Hugging Face tokenizer needs transformers: pip install 'lightning_seqpar[hf]'.") from error
    return HFTokenizer(AutoTokenizer.from_pretrained(spec), name=name)


def render_chat(hf: Any, conversations: list[list[dict]], generation_prompt: bool) -> list[str]:
    """The chat template's texts of ``conversations`` (lists of plain ``{"role", "content"}`` dicts, checked): what
    ``apply_chat_template(conversations, tokenize=False)`` returns, through transformers' ``render_jinja_template``,
    which it calls after normalizing message objects (plain dicts need none; the normalization was ~40 % of the
    rendering); ``apply_chat_template`` itself where that function is missing."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        render_jinja_template = None
    if render_jinja_template is None or getattr(hf, "get_chat_template", None) is None:
        return hf.apply_chat_template(conversations, tokenize=False, add_generation_prompt=generation_prompt)
    texts, _ = render_jinja_template(conversations=conversations, chat_template=hf.get_chat_template(),
                                     add_generation_prompt=generation_prompt, **hf.special_tokens_map)
    return texts
