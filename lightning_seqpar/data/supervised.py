"""Supervised fine-tuning examples: token ids and which of them the loss is taken on.

A JSON Lines record is one of three formats (the first key present decides):

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation rendered with the tokenizer's own chat
  template (``apply_chat_template``); the loss is on the assistant's turns only. Which tokens those are is read from
  the template's ``{% generation %}`` markers when it has them (transformers' ``return_assistant_tokens_mask``), else
  by rendering the conversation up to each assistant turn: the turn's tokens are those between the prefix rendered
  with ``add_generation_prompt=True`` and the prefix that includes the turn (what TRL's and torchtune's maskers do).
- ``{"prompt": ..., "completion": ...}``: the two texts' tokens, then the end-of-text token; the loss is on the
  completion and the end-of-text token.
- ``{"text": ...}``: the text's tokens and the end-of-text token, all supervised.

Raises (:func:`render_record`): ``ValueError`` naming the record (its line) and the fix for a conversation with a
tokenizer that has no chat template, a template whose renderings of a conversation's prefixes are not prefixes of
its whole rendering, an unknown format, or a conversation with no assistant turn.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class SupervisedExample:
    """``ids`` ``[n]`` int64 and ``supervised`` ``[n]`` bool (the loss is taken on token i's prediction)."""

    ids: np.ndarray
    supervised: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def _hf(tokenizer: Any) -> Any:
    """The transformers tokenizer behind the data pipeline's :class:`~lightning_seqpar.hf.tokenizer.HFTokenizer`."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def template_identity(tokenizer: Any) -> str:
    """A hash of the chat template (empty when there is none): part of a token cache's key."""
    template = getattr(_hf(tokenizer), "chat_template", None) or ""
    return hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else ""


def _ids(rendered: Any) -> list[int]:
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def render_messages(messages: list[dict], tokenizer: Any, where: str) -> SupervisedExample:
    """A conversation rendered with the tokenizer's chat template, supervised on the assistant's turns."""
    hf = _hf(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise ValueError(f"{where}: a conversation (\"messages\"), but the tokenizer {getattr(tokenizer, 'name', '')} "
                         f"has no chat template to render it with. Set tokenizer.chat_template (the model's own, in "
                         f"tokenizer_config.json), or give the data as {{\"prompt\", \"completion\"}} records.")
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError(f"{where}: a conversation with no assistant turn has nothing to learn; drop it.")
    if _GENERATION.search(hf.chat_template):  # its {% generation %} markers say which tokens the assistant wrote
        full = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return SupervisedExample(np.asarray(_ids(full), dtype=np.int64),
                                 np.asarray(full["assistant_masks"], dtype=bool))
    ids = _ids(hf.apply_chat_template(messages, tokenize=True))
    supervised = np.zeros(len(ids), dtype=bool)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _ids(hf.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
        through = _ids(hf.apply_chat_template(messages[:i + 1], tokenize=True))
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise ValueError(f"{where}: the chat template renders the conversation up to turn {i} differently from "
                             f"the start of the whole conversation, so the assistant's tokens cannot be told apart. "
                             f"Add {{% generation %}} markers around the assistant's content in the template (what "
                             f"transformers' return_assistant_tokens_mask reads).")
        supervised[len(before):len(through)] = True
    return SupervisedExample(np.asarray(ids, dtype=np.int64), supervised)


def render_record(record: dict, tokenizer: Any, where: str) -> SupervisedExample:
    """One JSON Lines record as a :class:`SupervisedExample` (see the module docstring for the formats)."""
    if "messages" in record:
        return render_messages(record["messages"], tokenizer, where)
    eos = list(tokenizer.separator)
    if "prompt" in record and "completion" in record:
        prompt, completion = tokenizer.encode_batch([record["prompt"], record["completion"]])
        ids = np.concatenate([prompt, completion, np.asarray(eos, dtype=np.int64)])
        supervised = np.zeros(len(ids), dtype=bool)
        supervised[len(prompt):] = True
        return SupervisedExample(ids, supervised)
    if "text" in record:
        ids = np.concatenate([tokenizer.encode_batch([record["text"]])[0], np.asarray(eos, dtype=np.int64)])
        return SupervisedExample(ids, np.ones(len(ids), dtype=bool))
    raise ValueError(f"{where}: a record of keys {sorted(record)}; expected \"messages\" (a conversation), "
                     f"\"prompt\" and \"completion\", or \"text\".")
