"""Preference pairs for DPO: a prompt, a chosen and a rejected reply, as token ids and which of them are the reply.

A JSON Lines record is one of TRL's preference formats (``trl.data_utils``):

- ``{"prompt": str, "chosen": str, "rejected": str}`` (standard): each reply's tokens are the prompt's tokens, the
  reply's, then the end-of-text token; the reply and the end-of-text token are supervised.
- ``{"chosen": [messages], "rejected": [messages]}`` (conversational, implicit prompt): each conversation rendered
  with the tokenizer's chat template, supervised on its assistant turns (:mod:`~lightning_seqpar.data.supervised`);
  the shared prompt is detected: the tokens both renderings begin with are not supervised. A reply's opening tokens
  that equal the other reply's count as prompt too; that leaves the loss unchanged (those tokens' log-probabilities,
  under the same context, cancel in both the policy's and the reference's chosen-minus-rejected difference).
- ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (conversational, explicit prompt): the
  prompt's messages followed by each reply's, then as above.

Rows (:func:`pair_rows`): one sequence per row, padded at the end (``attention_mask`` 0 there), the chosen reply of
pair i in row ``2i`` and its rejected reply in row ``2i+1``, so a pair never straddles a micro-batch whose row count
is even. Labels are aligned with the inputs (transformers shifts them): ``labels[j] = ids[j]`` where token j is
supervised, else ``-100``.

Packed rows (:func:`packed_pair_rows`, TRL's ``padding_free``): pairs placed in order, each pair's chosen then rejected
reply side by side in one row of ``s`` tokens, a new row started when the next pair does not fit. Position ids restart
at 0 at each reply, so the strategy's document-aware attention keeps each reply to itself (as packed supervised
examples, :mod:`~lightning_seqpar.data.packing`); each token's slot names its reply within the row (``2k`` and
``2k+1`` for the row's k-th pair), and the tail after the last pair is padding of its own.

Raises (:func:`render_pairs`, :func:`pair_rows`): ``ValueError`` naming the record (file and line) and the fix: not
an object, missing or mistyped keys, a conversation without a template or without an assistant reply, chosen and
rejected identical, a reply with no supervised token left (empty, or truncated away), a pair longer than the block
under ``overflow="refuse"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lightning_seqpar.data.packing import IGNORE, OVERFLOW
from lightning_seqpar.data.supervised import SupervisedExample, check_messages, known_roles, render_conversations

_KEYS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """A preference pair: ``chosen`` and ``rejected`` as :class:`SupervisedExample` s (prompt tokens unsupervised)."""

    chosen: SupervisedExample
    rejected: SupervisedExample


def _kind(record: Any, where: str) -> str:
    if not isinstance(record, dict) or not all(k in record for k in _KEYS):
        found = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ValueError(f"{where}: {found}; a preference record is {{\"prompt\", \"chosen\", \"rejected\"}} (texts) "
                         f"or {{\"chosen\": [messages], \"rejected\": [messages]}} (with an optional \"prompt\": "
                         f"[messages]).")
    if all(isinstance(record[k], str) for k in _KEYS):
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{where}: \"chosen\" and \"rejected\" are texts, so \"prompt\" must be a text too "
                             f"(found {type(record.get('prompt')).__name__}).")
        return "text"
    if all(isinstance(record[k], list) for k in _KEYS) and isinstance(record.get("prompt", []), list):
        return "messages"
    types = {k: type(record.get(k)).__name__ for k in ("prompt",) + _KEYS}
    raise ValueError(f"{where}: prompt/chosen/rejected are {types}; give all three as texts, or chosen and rejected "
                     f"(and prompt, if any) as lists of messages.")


def _shared_prompt(chosen: SupervisedExample, rejected: SupervisedExample) -> tuple[SupervisedExample, ...]:
    """Both conversations with the tokens they begin with in common unsupervised (the shared prompt)."""
    n = min(len(chosen), len(rejected))
    differ = np.flatnonzero(chosen.ids[:n] != rejected.ids[:n])
    common = int(differ[0]) if len(differ) else n
    out = []
    for example in (chosen, rejected):
        supervised = example.supervised.copy()
        supervised[:common] = False
        out.append(SupervisedExample(example.ids, supervised))
    return tuple(out)


def render_pairs(records: Sequence[Any], tokenizer: Any, wheres: Sequence[str]) -> list[PreferencePair]:
    """JSON Lines records as :class:`PreferencePair` s (formats in the module docstring); ``wheres[i]`` names record
    i in errors. Texts are tokenized in one batch, conversations rendered in one batch.

    Raises:
        ValueError: see the module docstring.
    """
    kinds = [_kind(record, where) for record, where in zip(records, wheres)]
    out: list[Any] = [None] * len(records)
    texts = [i for i, kind in enumerate(kinds) if kind == "text"]
    if texts:
        eos = np.asarray(list(tokenizer.separator), dtype=np.int64)
        ids = tokenizer.encode_batch([records[i][k] for i in texts for k in ("prompt",) + _KEYS])
        for n, i in enumerate(texts):
            prompt = np.asarray(ids[3 * n], dtype=np.int64)
            examples = []
            for reply in ids[3 * n + 1:3 * n + 3]:
                joined = np.concatenate([prompt, np.asarray(reply, dtype=np.int64), eos])
                supervised = np.zeros(len(joined), dtype=bool)
                supervised[len(prompt):] = True
                examples.append(SupervisedExample(joined, supervised))
            out[i] = PreferencePair(*examples)
    chats = [i for i, kind in enumerate(kinds) if kind == "messages"]
    if chats:
        roles = known_roles(tokenizer)
        conversations, names = [], []
        for i in chats:
            prompt = check_messages(records[i].get("prompt", []), roles, wheres[i]) if records[i].get("prompt") else []
            for key in _KEYS:
                conversations.append(prompt + check_messages(records[i][key], roles, f"{wheres[i]} ({key})"))
                names.append(f"{wheres[i]} ({key})")
        rendered = render_conversations(conversations, tokenizer, names)
        for n, i in enumerate(chats):
            out[i] = PreferencePair(*_shared_prompt(rendered[2 * n], rendered[2 * n + 1]))
    for pair, where in zip(out, wheres):
        if np.array_equal(pair.chosen.ids, pair.rejected.ids):
            raise ValueError(f"{where}: the chosen and rejected replies are the same, so the pair prefers nothing. "
                             f"Drop the record.")
    return out


@dataclass(frozen=True)
class PairRows:
    """Padded rows of preference pairs (see the module docstring): ``input_ids``, ``labels``, ``attention_mask``
    ``[pairs, 2, s]`` int64 (index 0 chosen, 1 rejected)."""

    input_ids: np.ndarray
    labels: np.ndarray
    attention_mask: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def supervised(self) -> np.ndarray:
        """One per pair ``[pairs]``: a step's count of them is its number of pairs (what the DPO loss averages)."""
        return np.ones(len(self), dtype=np.int64)

    @property
    def pairs(self) -> int:
        """The pairs in all rows."""
        return len(self)

    @property
    def reply_tokens(self) -> np.ndarray:
        """Supervised tokens of each reply after transformers' shift ``[pairs, 2]``."""
        return (self.labels[..., 1:] != IGNORE).sum(-1)


def _fit(example: SupervisedExample, s: int, overflow: str, where: str) -> SupervisedExample:
    truncated = len(example) > s
    if truncated:
        if overflow != "truncate":
            raise ValueError(f"{where}: {len(example)} tokens, longer than the block of {s}. Drop it, raise "
                             f"data.block_size, or set data.overflow=truncate to keep its first {s} tokens.")
        example = SupervisedExample(example.ids[:s], example.supervised[:s])
    if not example.supervised[1:].any():  # no reply token is predicted: its log-probability would be 0
        why = f"its first {s} tokens hold no reply token" if truncated else "it has no reply token"
        raise ValueError(f"{where}: {why} (an empty reply, or a prompt that fills the block). Drop the record, "
                         f"shorten its prompt, or raise data.block_size.")
    return example


def pair_rows(pairs: Sequence[PreferencePair], s: int, pad_id: int, overflow: str = "refuse",
              names: Sequence[str] = ()) -> PairRows:
    """Padded rows of ``s`` tokens, a pair's two replies side by side (see the module docstring).

    Raises:
        ValueError: an unknown ``overflow``; a reply longer than ``s`` under ``overflow="refuse"`` or with no
            supervised token left; naming ``names[i]`` (or "pair i") and the fix.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r}: one of {OVERFLOW}.")
    ids = np.full((len(pairs), 2, s), pad_id, dtype=np.int64)
    labels = np.full((len(pairs), 2, s), IGNORE, dtype=np.int64)
    mask = np.zeros((len(pairs), 2, s), dtype=np.int64)
    for i, pair in enumerate(pairs):
        where = names[i] if i < len(names) else f"pair {i}"
        for j, (key, example) in enumerate(zip(_KEYS, (pair.chosen, pair.rejected))):
            example = _fit(example, s, overflow, f"{where} ({key})")
            n = len(example)
            ids[i, j, :n] = example.ids
            labels[i, j, :n] = np.where(example.supervised, example.ids, IGNORE)
            mask[i, j, :n] = 1
    return PairRows(ids, labels, mask)


@dataclass(frozen=True)
class PackedPairRows:
    """Preference pairs packed into rows of ``s`` tokens (see the module docstring): ``input_ids``, ``labels``,
    ``position_ids`` ``[rows, s]`` int64; ``slots`` ``[rows, s]`` int64, the reply each token belongs to in its row
    (``2k`` chosen and ``2k+1`` rejected of its k-th pair, ``-1`` the padding tail); ``pair_index`` ``[rows, K]`` int64,
    the pairs each row holds in order (``-1`` past its last), K the most any row holds."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    slots: np.ndarray
    pair_index: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def supervised(self) -> np.ndarray:
        """Pairs per row ``[rows]``: a step's sum of them is its number of pairs (what the DPO loss averages)."""
        return (self.pair_index >= 0).sum(1)

    @property
    def pairs(self) -> int:
        """The pairs in all rows."""
        return int(self.supervised.sum())

    def with_rows(self, rows: int, pad_id: int) -> "PackedPairRows":
        """These rows followed by empty ones (padding only, no pair) up to ``rows``: a split smaller than one batch
        of whole micro-batches still fills it (the empty rows weigh nothing in the loss)."""
        extra = rows - len(self)
        if extra <= 0:
            return self
        s = self.input_ids.shape[1]

        def grown(values: np.ndarray, fill: Any) -> np.ndarray:
            return np.concatenate([values, np.full((extra, *values.shape[1:]), fill, dtype=values.dtype)])

        positions = np.concatenate([self.position_ids, np.tile(np.arange(s), (extra, 1))])
        return PackedPairRows(grown(self.input_ids, pad_id), grown(self.labels, IGNORE), positions,
                              grown(self.slots, -1), grown(self.pair_index, -1))


def packed_pair_rows(pairs: Sequence[PreferencePair], s: int, pad_id: int, overflow: str = "refuse",
                     names: Sequence[str] = ()) -> PackedPairRows:
    """Rows of ``s`` tokens holding whole pairs, in order (see the module docstring). A pair's two replies share a row:
    under ``overflow="truncate"`` a pair longer than ``s`` keeps the first ``s // 2`` tokens of each reply.

    Raises:
        ValueError: an unknown ``overflow``; a pair longer than ``s`` under ``overflow="refuse"``, or a reply with no
            supervised token left; naming ``names[i]`` (or "pair i") and the fix.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r}: one of {OVERFLOW}.")
    fitted = []
    for i, pair in enumerate(pairs):
        where = names[i] if i < len(names) else f"pair {i}"
        replies = (pair.chosen, pair.rejected)
        length = sum(map(len, replies))
        if length > s and overflow != "truncate":
            raise ValueError(f"{where}: its two replies take {length} tokens, more than the block of {s} they share "
                             f"when pairs are packed. Raise data.block_size, set data.overflow=truncate (each reply "
                             f"keeps its first {s // 2} tokens), or train without packing (dpo.packing=false).")
        limit = s if length <= s else s // 2
        fitted.append(tuple(_fit(reply, limit, overflow, f"{where} ({key})") for key, reply in zip(_KEYS, replies)))
    groups: list[list[int]] = []
    used = 0
    for i, replies in enumerate(fitted):
        length = sum(map(len, replies))
        if groups and used + length <= s:
            groups[-1].append(i)
            used += length
        else:
            groups.append([i])
            used = length
    width = max(map(len, groups), default=0)
    ids = np.full((len(groups), s), pad_id, dtype=np.int64)
    labels = np.full((len(groups), s), IGNORE, dtype=np.int64)
    positions = np.zeros((len(groups), s), dtype=np.int64)
    slots = np.full((len(groups), s), -1, dtype=np.int64)
    index = np.full((len(groups), width), -1, dtype=np.int64)
    for row, group in enumerate(groups):
        at = 0
        for k, i in enumerate(group):
            index[row, k] = i
            for j, reply in enumerate(fitted[i]):
                n = len(reply)
                ids[row, at:at + n] = reply.ids
                labels[row, at:at + n] = np.where(reply.supervised, reply.ids, IGNORE)
                labels[row, at] = IGNORE  # the previous reply's last position never predicts this one
                positions[row, at:at + n] = np.arange(n)
                slots[row, at:at + n] = 2 * k + j
                at += n
        positions[row, at:] = np.arange(s - at)  # the tail: a padding document of its own
    return PackedPairRows(ids, labels, positions, slots, index)
