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

Records are rendered in batches (:func:`render_records`): the template is rendered as text for the batch's
conversations and their prefixes, and the texts are tokenized in one call of the fast tokenizer, whose character
offsets place the assistant's turns (as transformers places ``{% generation %}`` spans); the ids are
``apply_chat_template(tokenize=True)``'s.

Raises (:func:`render_record`, :func:`render_records`): ``ValueError`` naming the record (its line) and the fix for a
conversation with a tokenizer that has no chat template, a template whose renderings of a conversation's prefixes are
not prefixes of its whole rendering, an unknown format, a conversation with no assistant turn, ``messages`` that are
not a list of ``{"role", "content"}`` objects with string contents, or a role the template does not know.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lightning_seqpar.hf.tokenizer import render_chat

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_NAMED_ROLE = re.compile(r"""role['"]?\]?\s*==\s*['"]([A-Za-z_]+)['"]""")
STANDARD_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class SupervisedExample:
    """``ids`` ``[n]`` integers and ``supervised`` ``[n]`` bool (the loss is taken on token i's prediction)."""

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


def known_roles(tokenizer: Any) -> tuple[str, ...]:
    """The roles a conversation may use: the standard ones and any other the chat template tests for by name."""
    template = str(getattr(_hf(tokenizer), "chat_template", None) or "")
    named = [r for r in _NAMED_ROLE.findall(template) if r not in STANDARD_ROLES]
    return STANDARD_ROLES + tuple(dict.fromkeys(named))


def check_messages(messages: Any, roles: Sequence[str], where: str) -> list[dict]:
    """``messages`` if it is a conversation the template can render: a list of ``{"role", "content"}`` objects, string
    contents, known roles, an assistant turn.

    Raises:
        ValueError: naming the record, the message and the fix.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" is {type(messages).__name__} {str(messages)[:40]!r}; expected a list "
                         f"of {{\"role\": ..., \"content\": ...}} objects.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {i} is {str(message)[:60]!r}; each message needs a \"role\" and a "
                             f"\"content\".")
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}: message {i}'s content is {type(message['content']).__name__} "
                             f"{str(message['content'])[:40]!r}; expected a string (text only).")
        if message["role"] not in roles:
            raise ValueError(f"{where}: message {i} has role {message['role']!r}, which the chat template does not "
                             f"know; the roles are {', '.join(roles)}. Rename it (the model's replies: "
                             f"\"assistant\").")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: a conversation with no assistant turn (roles "
                         f"{', '.join(dict.fromkeys(m['role'] for m in messages))}) has nothing to learn; drop it, or "
                         f"name the model's replies \"assistant\".")
    return messages


def _no_template(tokenizer: Any, where: str) -> ValueError:
    return ValueError(f"{where}: a conversation (\"messages\"), but the tokenizer {getattr(tokenizer, 'name', '')} "
                      f"has no chat template to render it with. Set tokenizer.chat_template (the model's own, in "
                      f"tokenizer_config.json), or give the data as {{\"prompt\", \"completion\"}} records.")


def _overlapping(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Tokens whose characters ``[start, end)`` overlap a span (transformers' rule for ``{% generation %}`` spans;
    the spans in order, apart)."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), dtype=bool)
    tokens, bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2), np.asarray(spans, dtype=np.int64)
    first = np.searchsorted(bounds[:, 1], tokens[:, 0], side="right")  # the first span ending after the token starts
    inside = first < len(bounds)
    return inside & (tokens[:, 1] > bounds[np.minimum(first, len(bounds) - 1), 0])


def render_conversations(conversations: Sequence[list[dict]], tokenizer: Any,
                         wheres: Sequence[str]) -> list[SupervisedExample]:
    """Checked conversations rendered with the chat template, supervised on the assistant's turns (see the module
    docstring): one template call for the batch's texts, one per kind of prefix, one tokenizer call."""
    hf = _hf(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise _no_template(tokenizer, wheres[0])
    if _GENERATION.search(hf.chat_template):  # its {% generation %} markers say which tokens the assistant wrote
        full = hf.apply_chat_template(list(conversations), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return [SupervisedExample(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool))
                for ids, mask in zip(full["input_ids"], full["assistant_masks"])]
    turns = [(c, i) for c, messages in enumerate(conversations)
             for i, message in enumerate(messages) if message["role"] == "assistant"]
    texts = render_chat(hf, list(conversations), False)
    rendered: dict[tuple[int, int, bool], str] = {}
    for prompt in (True, False):  # before the turn (with the generation prompt), and through it
        keys = [(c, i + (0 if prompt else 1)) for c, i in turns]
        asked = [(c, n) for c, n in keys if n > 0]  # an assistant turn first: nothing before it
        if asked:
            out = render_chat(hf, [conversations[c][:n] for c, n in asked], prompt)
            rendered.update({(c, n, prompt): text for (c, n), text in zip(asked, out)})
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    for c, i in turns:
        before, through = rendered.get((c, i, True), ""), rendered[(c, i + 1, False)]
        if not through.startswith(before) or not texts[c].startswith(through):
            raise ValueError(f"{wheres[c]}: the chat template renders the conversation up to turn {i} differently from "
                             f"the start of the whole conversation, so the assistant's tokens cannot be told apart. "
                             f"Add {{% generation %}} markers around the assistant's content in the template (what "
                             f"transformers' return_assistant_tokens_mask reads).")
        spans[c].append((len(before), len(through)))
    if not getattr(hf, "is_fast", False):  # no character offsets: the turns' token counts from their prefixes
        return [_by_prefix_ids(conversations[c], texts[c], spans[c], hf) for c in range(len(conversations))]
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer itself: what apply_chat_template's call of the tokenizer runs
        encoded = backend.encode_batch(list(texts), add_special_tokens=False)
        return [SupervisedExample(np.asarray(e.ids, dtype=np.int64), _overlapping(e.offsets, spans[c]))
                for c, e in enumerate(encoded)]
    encoded = hf(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return [SupervisedExample(np.asarray(ids, dtype=np.int64), _overlapping(offsets, spans[c]))
            for c, (ids, offsets) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"]))]


def _by_prefix_ids(messages: list[dict], text: str, spans: list[tuple[int, int]], hf: Any) -> SupervisedExample:
    """A slow tokenizer's example: each turn's tokens lie between the token counts of its two prefixes' texts."""
    ids = _ids(hf(text, add_special_tokens=False))
    supervised = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        before, through = (_ids(hf(text[:n], add_special_tokens=False)) for n in (start, end))
        supervised[len(before):len(through)] = True
    return SupervisedExample(np.asarray(ids, dtype=np.int64), supervised)


def _text(record: dict, key: str, where: str) -> str:
    if not isinstance(record[key], str):
        raise ValueError(f"{where}: \"{key}\" is {type(record[key]).__name__} {str(record[key])[:40]!r}; expected a "
                         f"string.")
    return record[key]


def _format(record: Any, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object; expected {{\"messages\": [...]}}, "
                         f"{{\"prompt\", \"completion\"}} or {{\"text\"}}.")
    for kind, keys in (("messages", ("messages",)), ("pair", ("prompt", "completion")), ("text", ("text",))):
        if all(k in record for k in keys):
            return kind
    raise ValueError(f"{where}: a record of keys {sorted(record)}; expected \"messages\" (a conversation), "
                     f"\"prompt\" and \"completion\", or \"text\".")


def render_records(records: Sequence[Any], tokenizer: Any, wheres: Sequence[str]) -> list[SupervisedExample]:
    """JSON Lines records as :class:`SupervisedExample` s (see the module docstring for the formats), each checked
    first; ``wheres[i]`` names record i in errors. Conversations, pairs and texts are each rendered in one batch."""
    kinds = [_format(record, where) for record, where in zip(records, wheres)]
    out: list[Any] = [None] * len(records)
    chats = [i for i, kind in enumerate(kinds) if kind == "messages"]
    if chats:
        if not getattr(_hf(tokenizer), "chat_template", None):
            raise _no_template(tokenizer, wheres[chats[0]])
        roles = known_roles(tokenizer)
        conversations = [check_messages(records[i]["messages"], roles, wheres[i]) for i in chats]
        for i, example in zip(chats, render_conversations(conversations, tokenizer, [wheres[i] for i in chats])):
            out[i] = example
    eos = np.asarray(list(tokenizer.separator), dtype=np.int64)
    pairs = [i for i, kind in enumerate(kinds) if kind == "pair"]
    if pairs:
        ids = tokenizer.encode_batch([_text(records[i], k, wheres[i]) for i in pairs for k in ("prompt", "completion")])
        for n, i in enumerate(pairs):
            prompt, completion = ids[2 * n], ids[2 * n + 1]
            joined = np.concatenate([prompt, completion, eos]).astype(np.int64)
            supervised = np.zeros(len(joined), dtype=bool)
            supervised[len(prompt):] = True
            out[i] = SupervisedExample(joined, supervised)
    texts = [i for i, kind in enumerate(kinds) if kind == "text"]
    if texts:
        for i, ids in zip(texts, tokenizer.encode_batch([_text(records[i], "text", wheres[i]) for i in texts])):
            joined = np.concatenate([ids, eos]).astype(np.int64)
            out[i] = SupervisedExample(joined, np.ones(len(joined), dtype=bool))
    return out


def render_record(record: dict, tokenizer: Any, where: str) -> SupervisedExample:
    """One JSON Lines record as a :class:`SupervisedExample` (see the module docstring for the formats)."""
    return render_records([record], tokenizer, [where])[0]
